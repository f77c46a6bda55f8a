"""Triton kernel: GELU (tanh) and per-token quantization of a linear layer's input, in one pass.

The ``backend="triton"`` path of :func:`omni_kernels.quant.quantize_activated_per_token`,
defined by :func:`omni_kernels.quant.reference.quantize_activated_reference`. It
serves the linear layers that read a GELU's output: a DiT's MLP down projection
(``ff.net.2`` reads ``GELU(ff.net.0.proj(x))``) and Flux's single blocks'
``proj_out`` (reads ``cat(attention output, GELU(proj_mlp(x)))``: the GELU
applies from column ``activation_from`` on). Unfused, the GELU writes its
16-bit output and the quantization reads it back; under ``torch.compile``
Inductor splits a wide row's GELU + absolute maximum + cast into two passes
(an H200 profile of Flux: 10.8 ms a step for the single blocks' inputs).

One program per row. A row of up to ``MAX_TILE`` elements (every DiT MLP
width: Flux 15360, Wan 13824) is loaded once into registers: GELU, the absolute
maximum and the quantized values come from the same registers, so HBM sees one
read of the pre-activation and one write of ``q``. Longer rows loop over chunks
and re-read them (from L2) for the second pass.

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

# sqrt(2 / pi)
_GELU_C = tl.constexpr(0.7978845608028654)


@triton.jit
def _gelu_tanh_from(x, cols, activation_from):
    """GELU (tanh approximation) of float32 ``x`` where ``cols >= activation_from``; ``x`` elsewhere."""
    u = _GELU_C * (x + 0.044715 * x * x * x)
    t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
    return tl.where(cols >= activation_from, 0.5 * x * (1.0 + t), x)


@triton.jit
def _activated_row(x_row, cols, mask, activation_from, clamp_val, HAS_CLAMP: tl.constexpr):
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    y = _gelu_tanh_from(x, cols, activation_from)
    if HAS_CLAMP:
        y = tl.minimum(tl.maximum(y, -clamp_val), clamp_val)
    return tl.where(mask, y, 0.0)


@triton.jit
def _quantize_activated_kernel(
    x_ptr, q_ptr, s_ptr,
    K, activation_from, x_row_stride, q_row_stride, clamp_val,
    HAS_CLAMP: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr, MIN_AMAX: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE_TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    q_row = q_ptr + row * q_row_stride
    if SINGLE_TILE:
        cols = tl.arange(0, BLOCK_K)
        mask = cols < K
        y = _activated_row(x_row, cols, mask, activation_from, clamp_val, HAS_CLAMP)
        amax = tl.maximum(tl.max(tl.abs(y), axis=0), MIN_AMAX)
        tl.store(s_ptr + row, tl.math.div_rn(amax, QMAX))
        quantize_store(y, tl.math.div_rn(QMAX, amax), q_row, cols, mask, QMAX, IS_INT8, USE_LIBDEVICE)
    else:
        amax_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            y = _activated_row(x_row, cols, cols < K, activation_from, clamp_val, HAS_CLAMP)
            amax_acc = tl.maximum(amax_acc, tl.abs(y))
        amax = tl.maximum(tl.max(amax_acc, axis=0), MIN_AMAX)
        tl.store(s_ptr + row, tl.math.div_rn(amax, QMAX))
        inv = tl.math.div_rn(QMAX, amax)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = cols < K
            y = _activated_row(x_row, cols, mask, activation_from, clamp_val, HAS_CLAMP)
            quantize_store(y, inv, q_row, cols, mask, QMAX, IS_INT8, USE_LIBDEVICE)


def launch_quantize_activated_triton(
    x: torch.Tensor,
    activation_from: int,
    clamp: float,
    out_dtype: torch.dtype,
    *,
    max_tile: int = MAX_TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GELU on the columns ``activation_from:`` of ``x`` ``[M, K]`` (unit column stride),
    then per-row quantization; returns ``(q [M, K] out_dtype, scale [M, 1] float32)``.

    Arguments are validated by :func:`omni_kernels.quant.quantize_activated_per_token`;
    ``clamp <= 0`` means no clamp; ``max_tile`` exists for tests of the chunked path.
    Launched through ``torch.library.wrap_triton`` so that Inductor, which traces the
    ``triton_op`` wrapping this, calls the kernel from its generated code directly.
    """
    m, k = x.shape
    q = torch.empty((m, k), dtype=out_dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        scale.fill_(MIN_ABSMAX / qmax_of(out_dtype))
        return q, scale
    block, single, num_warps = launch_config(k, max_tile)
    wrap_triton(_quantize_activated_kernel)[(m,)](
        x, q, scale,
        k, activation_from, x.stride(0), q.stride(0), float(clamp),
        **row_quantization_constants(out_dtype, clamp, block, single),
        num_warps=num_warps,
    )
    return q, scale
