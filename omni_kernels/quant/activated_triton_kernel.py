"""Triton kernel: GELU (tanh) and per-token quantization of a linear layer's input, in one pass.

The ``backend="triton"`` path of :func:`omni_kernels.quant.quantize_activated_per_token`,
defined by :func:`omni_kernels.quant.reference.quantize_activated_reference`. It
serves the linear layers that read a GELU's output: a DiT's MLP down projection
(``ff.net.2`` reads ``GELU(ff.net.0.proj(x))``) and Flux's single blocks'
``proj_out`` (reads ``cat(attention output, GELU(proj_mlp(x)))``: the GELU
applies from column ``activation_from`` on). Unfused, the GELU writes its
16-bit output and the quantization reads it back; under ``torch.compile``
Inductor splits a wide row's GELU + absolute maximum + cast into two passes.

One program per row. A row of up to ``MAX_TILE`` elements (every DiT MLP
width: Flux 15360, Wan 13824) is loaded once into registers: GELU, the absolute
maximum and the quantized values come from the same registers, so HBM sees one
read of the pre-activation and one write of ``q``. Longer rows loop over chunks
and re-read them (from L2) for the second pass.

Flux's ``proj_out`` input can also be read without its ``cat``: with
``HAS_PREFIX`` the kernel reads the attention output (the prefix, taken as it is)
and the MLP's pre-activation through two pointers and writes the quantized
``cat(prefix, GELU(x))`` row, so the 16-bit ``cat`` is never written. Its values
are those of this kernel on the materialized ``cat`` with ``activation_from = K0``
(same float32 operations per element; the row maximum does not depend on order).

GELU's tanh is ``1 - 2 / (exp(2u) + 1)``, exact at both tails in float32 (the
exponential overflows to inf, or underflows to 0) and available under the
interpreter; it differs from ``torch.tanh`` by a few float32 ulps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from omni_kernels.quant.reference import MIN_ABSMAX, qmax_of
from omni_kernels.quant.triton_kernel import MAX_TILE, launch_config, quantize_store, row_quantization_constants

@triton.jit
def _gelu_tanh_from(x, cols, activation_from):
    """GELU (tanh approximation) of float32 ``x`` where ``cols >= activation_from``; ``x`` elsewhere.

    ``0.5 x (1 + tanh(u))`` with ``u = sqrt(2/pi) (x + 0.044715 x^3)`` is ``x / (1 + exp(-2u))``:
    one exp and one division a value, few operations (the kernel was bound by the GELU's
    arithmetic, not by memory), and accurate to a few ulp also where the GELU is
    tiny (large negative x: the division, not a difference near 1, makes the small value)."""
    # -1.5957691216057308 = -2 sqrt(2 / pi): the exponent is -2u.
    y = x / (1.0 + tl.exp(x * (1.0 + 0.044715 * x * x) * -1.5957691216057308))
    return tl.where(cols >= activation_from, y, x)


@triton.jit
def _clamped(y, mask, clamp_val, HAS_CLAMP: tl.constexpr):
    if HAS_CLAMP:
        y = tl.minimum(tl.maximum(y, -clamp_val), clamp_val)
    return tl.where(mask, y, 0.0)


@triton.jit
def _activated(x, cols, mask, activation_from, clamp_val, HAS_CLAMP: tl.constexpr):
    """float32 ``y`` of loaded values ``x`` (any float dtype) at columns ``cols`` (0 where not ``mask``)."""
    return _clamped(_gelu_tanh_from(x.to(tl.float32), cols, activation_from), mask, clamp_val, HAS_CLAMP)


@triton.jit
def _activated_row(x_row, cols, mask, activation_from, clamp_val, HAS_CLAMP: tl.constexpr):
    """float32 ``y`` of ``x``'s columns ``cols`` (0 where not ``mask``)."""
    return _activated(tl.load(x_row + cols, mask=mask, other=0.0), cols, mask, activation_from, clamp_val,
                      HAS_CLAMP)


@triton.jit
def _prefix_row(p_row, cols, mask, clamp_val, HAS_CLAMP: tl.constexpr):
    """float32 ``y`` of the prefix's columns ``cols``: the values as they are, clamped."""
    return _clamped(tl.load(p_row + cols, mask=mask, other=0.0).to(tl.float32), mask, clamp_val, HAS_CLAMP)


@triton.jit
def _row_chunk(p_row, x_row, cols, prefix_width, K, activation_from, clamp_val,
               HAS_PREFIX: tl.constexpr, HAS_CLAMP: tl.constexpr):
    """float32 ``y`` at the columns ``cols`` of the row ``cat(prefix, x)`` (``prefix_width + K``
    long; 0 past its end), for the chunked path: a chunk may straddle the two sources."""
    if HAS_PREFIX:
        x_cols = cols - prefix_width
        y = _activated_row(x_row, x_cols, (x_cols >= 0) & (x_cols < K), activation_from, clamp_val, HAS_CLAMP)
        in_prefix = cols < prefix_width
        y = tl.where(in_prefix, _prefix_row(p_row, cols, in_prefix, clamp_val, HAS_CLAMP), y)
    else:
        y = _activated_row(x_row, cols, cols < K, activation_from, clamp_val, HAS_CLAMP)
    return y


@triton.jit
def _quantize_activated_kernel(
    x_ptr, p_ptr, q_ptr, s_ptr,
    K, prefix_width, activation_from, x_row_stride, p_row_stride, q_row_stride, clamp_val,
    HAS_PREFIX: tl.constexpr, HAS_CLAMP: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr,
    MIN_AMAX: tl.constexpr, USE_LIBDEVICE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    SINGLE_TILE: tl.constexpr, RECOMPUTE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    p_row = p_ptr + row * p_row_stride
    q_row = q_ptr + row * q_row_stride
    if SINGLE_TILE:
        # x's tile (and the prefix's) stays in registers from the load to the store.
        cols = tl.arange(0, BLOCK_K)
        mask = cols < K
        if RECOMPUTE:
            # Only the 16-bit input stays live across the row's reduction; the GELU runs
            # again for the store (same operations, same values): fewer registers a thread.
            x = tl.load(x_row + cols, mask=mask, other=0.0)
            amax = tl.max(tl.abs(_activated(x, cols, mask, activation_from, clamp_val, HAS_CLAMP)), axis=0)
        else:
            y = _activated_row(x_row, cols, mask, activation_from, clamp_val, HAS_CLAMP)
            amax = tl.max(tl.abs(y), axis=0)
        if HAS_PREFIX:
            p_cols = tl.arange(0, BLOCK_P)
            p_mask = p_cols < prefix_width
            y_p = _prefix_row(p_row, p_cols, p_mask, clamp_val, HAS_CLAMP)
            amax = tl.maximum(amax, tl.max(tl.abs(y_p), axis=0))
        amax = tl.maximum(amax, MIN_AMAX)
        tl.store(s_ptr + row, tl.math.div_rn(amax, QMAX))
        inv = tl.math.div_rn(QMAX, amax)
        if HAS_PREFIX:
            quantize_store(y_p, inv, q_row, p_cols, p_mask, QMAX, IS_INT8, USE_LIBDEVICE)
        if RECOMPUTE:
            y = _activated(x, cols, mask, activation_from, clamp_val, HAS_CLAMP)
        quantize_store(y, inv, q_row + prefix_width, cols, mask, QMAX, IS_INT8, USE_LIBDEVICE)
    else:
        # Long rows: chunks of the row cat(prefix, x), re-read (from L2) for the second pass.
        width = prefix_width + K
        amax_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, width, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            y = _row_chunk(p_row, x_row, cols, prefix_width, K, activation_from, clamp_val, HAS_PREFIX, HAS_CLAMP)
            amax_acc = tl.maximum(amax_acc, tl.abs(y))
        amax = tl.maximum(tl.max(amax_acc, axis=0), MIN_AMAX)
        tl.store(s_ptr + row, tl.math.div_rn(amax, QMAX))
        inv = tl.math.div_rn(QMAX, amax)
        for k0 in range(0, width, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            y = _row_chunk(p_row, x_row, cols, prefix_width, K, activation_from, clamp_val, HAS_PREFIX, HAS_CLAMP)
            quantize_store(y, inv, q_row, cols, cols < width, QMAX, IS_INT8, USE_LIBDEVICE)


def launch_quantize_activated_triton(
    x: torch.Tensor,
    activation_from: int,
    clamp: float,
    out_dtype: torch.dtype,
    *,
    prefix: torch.Tensor | None = None,
    max_tile: int = MAX_TILE,
    num_warps: int | None = None,
    recompute_activation: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GELU on the columns ``activation_from:`` of ``x`` ``[M, K]``, then per-row quantization of
    ``cat(prefix, GELU part of x)``; returns ``(q [M, K0 + K] out_dtype, scale [M, 1] float32)``.

    ``prefix`` (``None``: ``K0 = 0``) is ``[M, K0]`` in ``x``'s dtype, its columns taken as they
    are and stored first, read through its own pointer: the two need unit column stride, their
    row strides are free (a column slice of a wider tensor is read in place). With a prefix,
    ``activation_from`` is 0. The row goes through one register tile when ``K0 + K <= max_tile``
    (the materialized ``cat``'s criterion; with a prefix the registers hold a tile of each,
    ``next_pow2(K0) + next_pow2(K)`` values), in chunks otherwise.

    Arguments are validated by :func:`omni_kernels.quant.quantize_activated_per_token`;
    ``clamp <= 0`` means no clamp; ``max_tile`` exists for tests of the chunked path;
    ``num_warps`` (a power of two, 1 to 32; ``None``: :func:`~omni_kernels.quant.triton_kernel.launch_config`'s,
    at most 8) and ``recompute_activation`` (single-tile rows: keep only the 16-bit input in
    registers across the row's reduction and apply the GELU again for the store; same values)
    are for tuning. Compiled for sm_90 with Triton 3.6, ``recompute_activation`` gives the same
    machine code as the default: LLVM merges the two GELUs (64 ``MUFU.EX2`` a thread either way
    at Flux's 3072 + 12288 row, 8 warps, 97 registers), hence its equal timings. Launched through ``torch.library.wrap_triton`` so that Inductor,
    which traces the ``triton_op`` wrapping this, calls the kernel from its generated code directly.
    """
    if num_warps is not None and (isinstance(num_warps, bool) or num_warps not in (1, 2, 4, 8, 16, 32)):
        raise ValueError(f"num_warps must be None or a power of two from 1 to 32; got {num_warps!r}")
    m, k = x.shape
    prefix_width = prefix.shape[1] if prefix is not None else 0
    width = prefix_width + k
    q = torch.empty((m, width), dtype=out_dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0 or width == 0:
        scale.fill_(MIN_ABSMAX / qmax_of(out_dtype))
        return q, scale
    has_prefix = prefix_width > 0
    block, single, default_warps = launch_config(width, max_tile)
    if single:
        block = max(16, triton.next_power_of_2(k))
    wrap_triton(_quantize_activated_kernel)[(m,)](
        x, prefix if has_prefix else x, q, scale,
        k, prefix_width, activation_from, x.stride(0), prefix.stride(0) if has_prefix else 0, q.stride(0),
        float(clamp),
        HAS_PREFIX=has_prefix,
        RECOMPUTE=bool(recompute_activation),
        BLOCK_P=max(16, triton.next_power_of_2(prefix_width)) if has_prefix else 16,
        **row_quantization_constants(out_dtype, clamp, block, single),
        num_warps=num_warps or default_warps,
    )
    return q, scale
