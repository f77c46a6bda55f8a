"""Quantized attention forward in Triton: INT8 ``Q K^T``, FP8 e4m3 ``P V`` (SageAttention-2 style).

:func:`sage_attention_forward` quantizes ``q``/``k``/``v`` with the kernels of
:mod:`.quantize` and runs :func:`_sage_fwd_kernel` on the result; the math,
step by step, is :func:`.reference.quantized_attention_reference`.

Kernel design (same skeleton as the dense :mod:`omni_kernels.attention.triton_flash`)
---------------------------------------------------------------------------------
* One program per ``(query block of BLOCK_M rows, batch * query head)``, query
  block fastest so a head's K/V stream is shared through L2. On Hopper at
  head_dim 128 the default is ``BLOCK_M = 64`` with 4 warps (one warpgroup),
  ``BLOCK_N = 128``, 3 stages (see :func:`default_config`).
* ``S = Q_int8 K_int8^T`` is an ``int8 x int8 -> int32`` ``tl.dot`` (wgmma
  ``s8``, twice bf16's rate); it is exact, and one multiply by
  ``q_scale[row] * k_scale[block] * scale * log2(e)`` turns it into base-2 logits.
* The running max is kept shifted by ``log2(448)`` so ``P = exp2(S - m)`` spans
  FP8's range ``[0, 448]`` at no cost; ``P`` goes to ``float8e4nv`` and
  ``P V`` is an FP8 ``tl.dot`` (wgmma ``e4m3``) against V stored transposed
  (``[D, Skv_pad]``: the B operand of an FP8 wgmma must be K-major).
* Two-level accumulation: each block's ``P V`` lands in a fresh float32 tile
  which is then folded into the running accumulator with an fma
  (``acc * alpha + tile``), because Hopper's FP8 MMA accumulates with reduced
  precision (~14 bits) and must never sum across blocks (Triton may fold a plain
  ``acc * alpha + tile`` into ``dot(p, v, acc * alpha)``; it never folds an fma).
* V has one scale per key block, applied to the block's ``P V`` tile before the
  fold (``acc * alpha + tile * v_scale``, as :mod:`.reference` writes it), and
  ``1 / l`` once, in the epilogue.
* K/V are padded to a multiple of ``BLOCK_N`` by the quantizer (zeros), so the
  loop loads without masks; only the last partial block (``Skv`` or
  ``key_lengths[b]`` not a multiple of ``BLOCK_N``) masks scores to ``-inf``.
* ``use_tma``: K, V^T and Q tiles through host-built TMA descriptors
  (``triton.tools.tensor_descriptor``), else plain pointer loads. TMA
  coordinates are int32 (rows of 2-D views, checked < 2**31 on the host);
  pointer arithmetic is int64.
* ``return_lse``: the log-sum-exp with K's mean added back (``scale * q . k_mean``
  from the unquantized q), so shards of keys merge exactly (see :mod:`.reference`).

Limits: forward only; not causal; head_dim 64 or 128; float16/bfloat16 in and
out (float32 too under the interpreter). Needs FP8 tensor cores: compute
capability >= 8.9 (Ada, Hopper, Blackwell).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from omni_kernels._device import cuda_capability, cuda_index
from omni_kernels._launch import gdc_wait, programmatic_launch_enabled
from omni_kernels._triton import cdiv, triton_interpreter_enabled, triton_unavailable_reason
from omni_kernels.attention.quantized.quantize import fp8_convert, quantize_qkv
from omni_kernels.attention.quantized.quantize_cuda import quantize_qkv_cuda
from omni_kernels.attention.quantized.reference import LOG2_FP8_MAX, LOG2E, QuantizedQKV
from omni_kernels.attention.triton_flash import bhs_sizes, bhs_strides

try:  # host-built TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except Exception:  # pragma: no cover - older Triton
    _TensorDescriptor = None

HEAD_DIMS = (64, 128)
MIN_CAPABILITY = (8, 9)
_LN2 = tl.constexpr(0.6931471805599453)
_SHIFT = tl.constexpr(LOG2_FP8_MAX)
# Scores start from the bits of the float 1.5 * 2^23 (SageConfig.score_bias): |Q K^T| < 2^22 for
# int8 codes and D <= 128, so the int32 sum stays in [2^23, 2^24), where a float's ulp is 1 and
# its bits read as the float 1.5 * 2^23 + s; one subtraction gives s exactly, without the
# int-to-float conversion (a quarter-rate instruction, like exp2, on Hopper).
_SCORE_BIAS_BITS = tl.constexpr(0x4B400000)
_SCORE_BIAS = tl.constexpr(12582912.0)


@triton.jit
def _sage_range(
    acc, l_i, m_i, q, row_scale,
    k_ptrs, v_ptrs, ks_ptr, vs_ptr, k_desc, v_desc, k_row0, v_row0,
    offs_n, lo, hi, kv_len, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    USE_TMA: tl.constexpr, EMULATE_FP8: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    SCORE_BIAS: tl.constexpr,
):
    """Online softmax over key blocks ``[lo, hi)``; ``MASKED`` masks keys ``>= kv_len``.

    ``k_ptrs``/``v_ptrs``/``ks_ptr``/``vs_ptr`` point at key block 0's K tile ``[BLOCK_N, D]``,
    V^T tile ``[D, BLOCK_N]``, K scale and V scale; ``k_row0``/``v_row0`` (int32) are the
    head's first row in the TMA views. Addresses are formed from ``start_n``
    (no loop-carried pointers), which Triton's warp specialization needs.
    ``acc`` is in V's real units (each tile times its block's V scale).
    """
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if USE_TMA:
            k = k_desc.load([k_row0 + start_n, 0])
        else:
            k = tl.load(k_ptrs + start_n.to(tl.int64) * HEAD_DIM)
        if SCORE_BIAS:
            bias = tl.full((q.shape[0], BLOCK_N), _SCORE_BIAS_BITS, tl.int32)
            # (out_dtype names the int32 accumulator: the GPU frontend asserts acc's type against it)
            s_int = tl.dot(q, tl.trans(k), acc=bias, out_dtype=tl.int32)  # int8 x int8 -> int32, exact, biased
            s = s_int.to(tl.float32, bitcast=True) - _SCORE_BIAS
        else:
            s_int = tl.dot(q, tl.trans(k))  # int8 x int8 -> int32, exact
            s = s_int.to(tl.float32)
        factor = row_scale * (tl.load(ks_ptr + start_n // BLOCK_N) * qk_scale)  # >= 0
        # m is kept shifted by log2(448): p = exp2(s - m) fills FP8's [0, 448]
        if MASKED:
            s = tl.where((start_n + offs_n)[None, :] < kv_len, s * factor[:, None], float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) - _SHIFT)
            p = tl.math.exp2(s - m_new[:, None])
        else:
            # factor >= 0, so max(s) * factor == max(s * factor); the scaling then
            # folds into one fma per score.
            m_new = tl.maximum(m_i, tl.max(s, 1) * factor - _SHIFT)
            p = tl.math.exp2(s * factor[:, None] - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if USE_TMA:
            vt = v_desc.load([v_row0, start_n])
        else:
            vt = tl.load(v_ptrs + start_n)
        # A fresh float32 tile per block, folded in with an fma: Triton combines
        # `x + dot(a, b, 0)` into `dot(a, b, x)`, which would let the FP8 MMA's
        # short accumulator sum across blocks; an fma is not rewritten.
        pv = tl.dot(fp8_convert(p, EMULATE_FP8), tl.trans(vt))
        v_scale = tl.load(vs_ptr + start_n // BLOCK_N)
        acc = tl.fma(acc, tl.broadcast_to(alpha[:, None], acc.shape), pv * v_scale)
    return acc, l_i, m_i


@triton.jit
def _sage_fwd_kernel(
    Q8, QS, QKMEAN, K8, KS, VT8, VS, Out, LSE, KEY_LENGTHS,
    q_desc, k_desc, v_desc,
    stride_ob, stride_oh, stride_om,
    num_heads, num_kv_heads, seq_q, seq_k, seq_k_pad, num_m_blocks,
    scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_KEY_LENGTHS: tl.constexpr, RETURN_LSE: tl.constexpr, USE_TMA: tl.constexpr,
    EMULATE_FP8: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, SCORE_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # launched while the quantizer may still run: wait for its codes first
        gdc_wait()
    pid = tl.program_id(0)
    pid_bh = pid // num_m_blocks
    m_block = pid % num_m_blocks
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    # int32 row indices for TMA coordinates (32-bit by hardware and by Triton;
    # the host checks every view has < 2**31 rows), int64 for pointer math.
    kv_bh32 = b * num_kv_heads + h // (num_heads // num_kv_heads)
    kv_bh = kv_bh32.to(tl.int64)
    start_m = m_block * BLOCK_M

    kv_len = seq_k
    if HAS_KEY_LENGTHS:
        kv_len = tl.minimum(tl.maximum(tl.load(KEY_LENGTHS + b), 0), seq_k)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_q
    q_rows = pid_bh.to(tl.int64) * seq_q + offs_m  # rows of the [B*Hq*Sq, D] int8 Q

    if USE_TMA:
        q = q_desc.load([pid_bh * seq_q + start_m, 0])  # rows past the head are never stored
    else:
        q = tl.load(Q8 + q_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0)
    row_scale = tl.load(QS + q_rows, mask=row_ok, other=0.0)

    k_ptrs = K8 + (kv_bh * seq_k_pad + offs_n[:, None]) * HEAD_DIM + offs_d[None, :]
    v_ptrs = VT8 + (kv_bh * HEAD_DIM + offs_d[:, None]) * seq_k_pad + offs_n[None, :]
    ks_ptr = KS + kv_bh * (seq_k_pad // BLOCK_N)
    vs_ptr = VS + kv_bh * (seq_k_pad // BLOCK_N)
    k_row0 = kv_bh32 * seq_k_pad
    v_row0 = kv_bh32 * HEAD_DIM

    # m starts finite, so a row whose keys are all masked never forms (-inf) - (-inf)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    full_end = (kv_len // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _sage_range(
        acc, l_i, m_i, q, row_scale, k_ptrs, v_ptrs, ks_ptr, vs_ptr, k_desc, v_desc, k_row0, v_row0,
        offs_n, 0, full_end, kv_len, qk_scale,
        HEAD_DIM, BLOCK_N, False, USE_TMA, EMULATE_FP8, WARP_SPECIALIZE, SCORE_BIAS,
    )
    acc, l_i, m_i = _sage_range(
        acc, l_i, m_i, q, row_scale, k_ptrs, v_ptrs, ks_ptr, vs_ptr, k_desc, v_desc, k_row0, v_row0,
        offs_n, full_end, kv_len, kv_len, qk_scale,
        HEAD_DIM, BLOCK_N, True, USE_TMA, EMULATE_FP8, False, SCORE_BIAS,
    )

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc * (1.0 / l_safe)[:, None]  # acc is 0 where l is 0
    o_ptrs = (
        Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :]
    )
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if RETURN_LSE:
        # The scores ran on K minus its mean, which shifts row i's log-sum-exp
        # by q_i . k_mean: add it back, so the LSE is that of the attention the
        # quantized inputs represent and partial results over different key
        # shards (ring attention, each shard with its own mean) merge correctly.
        # (q . k_mean comes from the unquantized q, so this term has no INT8 error.)
        q_kmean = tl.load(QKMEAN + q_rows, mask=row_ok, other=0.0)
        lse = tl.where(has_keys, (m_i + tl.math.log2(l_safe)) * _LN2 + q_kmean * scale, float("-inf"))
        tl.store(LSE + q_rows, lse, mask=row_ok)


# --------------------------------------------------------------------------- configs


KERNELS = ("triton", "cuda_sm90")


@dataclasses.dataclass(frozen=True)
class SageConfig:
    """Launch parameters; ``block_n`` is also the K quantization block.

    ``kernel``: ``"triton"`` (this module's kernel, every FP8-capable GPU) or
    ``"cuda_sm90"`` (the wgmma kernel of ``csrc/attention/sage_sm90.cu``: Hopper,
    head_dim 128, needs the compiled extension; its tile is fixed at 128 x 128 with
    three warpgroups and a 3-stage TMA ring, so ``block_m``/``block_n`` must be 128 and
    ``num_warps``/``num_stages``/``use_tma``/``warp_specialize``/``score_bias`` describe
    nothing for it). It sums P through its P V MMA, masks only a partial last block, and
    its two consumer warpgroups take turns on the tensor cores; it is the faster of the two
    on Hopper (bench/results/INDEX.md).

    ``score_bias``: the int32 ``Q K^T`` accumulator starts from the bits of the float
    ``1.5 * 2^23`` and the scores are read back by reinterpreting and subtracting: the same
    float32 values without an int-to-float conversion per score. Off by default (slower).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False  # K, V^T, Q through host-built TMA descriptors (sm_90+)
    warp_specialize: bool = False  # Triton's automatic producer/consumer warp specialization
    kernel: str = "triton"
    # S's int32 accumulator starts from a float bias, so the scores reach float32 without an
    # int-to-float conversion (same values; slower, hence off).
    score_bias: bool = False
    # cuda_sm90 only: quantize Q/K/V with omni's CUDA kernels (csrc/attention/sage_quant.cu)
    # instead of the Triton ones. Off: the Triton quantizer is the faster one.
    cuda_quantizer: bool = False
    # cuda_sm90 only: the last wave's query blocks cut into this many key ranges, merged in the
    # kernel (0: csrc/attention/sage_sm90_params.h's plan, which splits only a tail that fits
    # two or more parts per idle SM: one head of Flux 1.75x, SD3 1024^2 1.04x, Flux's 24 heads
    # unsplit; 1: never; 2..8: forced). A split part rounds P to FP8 under its own running max,
    # so the output moves within the FP8 rounding (~2e-3 rel L2 vs unsplit on DiT-like inputs).
    kv_splits: int = 0

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"SageConfig.kernel must be one of {KERNELS}; got {self.kernel!r}")
        if self.cuda_quantizer and self.kernel != "cuda_sm90":
            raise ValueError("SageConfig.cuda_quantizer applies to kernel='cuda_sm90' only (the CUDA "
                             f"quantizer writes V^T permuted for it); got kernel={self.kernel!r}")
        if not (isinstance(self.kv_splits, int) and 0 <= self.kv_splits <= MAX_KV_SPLITS):
            raise ValueError(f"SageConfig.kv_splits must be an int in [0, {MAX_KV_SPLITS}] (0: auto, "
                             f"1: never split); got {self.kv_splits!r}")
        if self.kv_splits and self.kernel != "cuda_sm90":
            raise ValueError("SageConfig.kv_splits applies to kernel='cuda_sm90' only; got "
                             f"kernel={self.kernel!r}")
        if self.kernel == "cuda_sm90" and (self.block_m, self.block_n) != (128, 128):
            raise ValueError("SageConfig(kernel='cuda_sm90') needs block_m=128 and block_n=128 "
                             f"(the CUDA kernel's fixed tile); got {self.block_m}, {self.block_n}")

    def describe(self) -> str:
        if self.kernel == "cuda_sm90":
            return ("cuda_sm90 M128xN128 (wgmma, 3-stage TMA, 2 consumer warpgroups"
                    + (", CUDA quantizer" if self.cuda_quantizer else "")
                    + (f", kv_splits={self.kv_splits}" if self.kv_splits else "") + ")")
        return (f"M{self.block_m}xN{self.block_n} w{self.num_warps} s{self.num_stages}"
                + ("+tma" if self.use_tma else "") + ("+ws" if self.warp_specialize else "")
                + ("+bias" if self.score_bias else ""))


MAX_KV_SPLITS = 8  # csrc/attention/sage_sm90_params.h's kSageMaxSplits (a test checks they agree)


CUDA_SM90_CONFIG = SageConfig(128, 128, 12, 3, kernel="cuda_sm90")


def cuda_sm90_unsupported_reason(device: torch.device, head_dim: int, dtype: torch.dtype) -> str | None:
    """None when ``SageConfig(kernel="cuda_sm90")`` can run on ``device`` with this head_dim and
    dtype, else why not (what is missing). Shapes are checked by :func:`unsupported_reason`."""
    device = torch.device(device)
    index = cuda_index(device) if device.type == "cuda" else -1
    return _cuda_sm90_reason(device.type, index, head_dim, dtype)


@functools.lru_cache(maxsize=None)
def _cuda_sm90_reason(device_type: str, index: int, head_dim: int, dtype: torch.dtype) -> str | None:
    """:func:`cuda_sm90_unsupported_reason`, cached (facts of the build and the device only)."""
    from omni_kernels._extension import compiled_extension_error, has_compiled_extension

    if not has_compiled_extension():
        return f"the cuda_sm90 kernel needs omni's compiled extension: {compiled_extension_error()}"
    if not hasattr(torch.ops.omni_kernels, "sage_attention_sm90"):
        return ("the cuda_sm90 kernel is missing from this build of omni_kernels._C "
                "(a ROCm build, or one older than the kernel): rebuild the extension")
    if device_type != "cuda":
        return f"the cuda_sm90 kernel runs on CUDA tensors; got {device_type}"
    cap = cuda_capability(index)
    if cap[0] != 9:
        return (f"the cuda_sm90 kernel needs a Hopper GPU (compute capability 9.0: wgmma, TMA); "
                f"{torch.cuda.get_device_name(index)} has {cap[0]}.{cap[1]}")
    if head_dim != 128:
        return f"the cuda_sm90 kernel takes head_dim 128; got {head_dim}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"the cuda_sm90 kernel takes float16 or bfloat16; got {dtype}"
    return None


_INTERPRETER_CONFIG = SageConfig(16, 16, 4, 1)
# Hopper, head_dim 128: the fastest config of bench/quantized_attention_tune.py. One warpgroup
# per 64 rows keeps the int32 scores, P and the float32 accumulator in registers without spilling.
_HOPPER_D128_CONFIG = SageConfig(64, 128, 4, 3)
_FALLBACK_CONFIG = SageConfig(128, 128, 8, 3)


def default_config(head_dim: int, device: torch.device | str | None = None) -> SageConfig:
    """The config :func:`sage_attention_forward` uses when none is given.

    * Hopper (compute capability 9.x), head_dim 128: ``M64xN128 w4 s3``
      (see ``_HOPPER_D128_CONFIG``).
    * Elsewhere (head_dim 64, Ada, Blackwell): ``M128xN128 w8 s3``, not measured.
    * Under the interpreter: 16x16 blocks.
    """
    if triton_interpreter_enabled():
        return _INTERPRETER_CONFIG
    device = torch.device(device) if device is not None else None
    if head_dim == 128 and device is not None and device.type == "cuda":
        if cuda_capability(cuda_index(device))[0] == 9:
            return _HOPPER_D128_CONFIG
    return _FALLBACK_CONFIG


# --------------------------------------------------------------------------- host side


def unsupported_reason(q, k, v, layout: str) -> str | None:
    """None when :func:`sage_attention_forward` takes these inputs, else why not."""
    if layout not in ("bhsd", "bshd"):
        return f"layout must be 'bhsd' or 'bshd'; got {layout!r}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return f"{name} must be a 4-D tensor ({layout}); got {getattr(t, 'shape', type(t).__name__)}"
        if t.stride(3) != 1:
            return f"{name}'s last dimension must be contiguous; got strides {tuple(t.stride())}"
    allowed = (torch.float16, torch.bfloat16) if q.is_cuda else (torch.float16, torch.float32)
    if q.dtype not in allowed or not (q.dtype == k.dtype == v.dtype):
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        where = "CUDA" if q.is_cuda else "CPU (Triton interpreter)"
        return f"dtype must be one of ({names}) on {where}, the same for q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.device == k.device == v.device):
        return f"q, k, v must share a device; got {q.device}, {k.device}, {v.device}"
    bq, hq, _, d = bhs_sizes(q, layout)
    bk, hk, sk, dk = bhs_sizes(k, layout)
    bv, hv, sv, dv = bhs_sizes(v, layout)
    if not (d == dk == dv) or d not in HEAD_DIMS:
        return f"head_dim must be one of {HEAD_DIMS} (the same for q, k, v); got {d}, {dk}, {dv}"
    if not (bq == bk == bv) or (hk, sk) != (hv, sv):
        return f"q, k, v shapes disagree: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} ({layout})"
    if hk == 0 or hq % hk:
        return f"query heads ({hq}) must be a multiple of key/value heads ({hk})"
    if q.is_cuda:
        index = cuda_index(q.device)
        cap = cuda_capability(index)
        if cap < MIN_CAPABILITY:
            return (
                f"needs FP8 tensor cores (compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: "
                f"Ada, Hopper, Blackwell); {torch.cuda.get_device_name(index)} has {cap[0]}.{cap[1]}"
            )
    return None


_TMA_MAX_ROWS = 2**31  # TMA coordinates are int32


def _tma_descriptors(qkv: QuantizedQKV, cfg: SageConfig):
    """TMA descriptors of the quantized Q ``[B*Hq*Sq, D]``, K ``[B*Hkv*Skv_pad, D]``
    and V^T ``[B*Hkv*D, Skv_pad]`` (all contiguous, one 2-D view each).

    Raises RuntimeError naming what is missing when ``cfg.use_tma`` cannot be
    honoured (so a tuning run never times the pointer path under a ``+tma`` name).
    """
    if _TensorDescriptor is None:
        raise RuntimeError("use_tma needs triton.tools.tensor_descriptor (Triton >= 3.4)")
    d = qkv.q_int8.shape[-1]
    q2 = qkv.q_int8.reshape(-1, d)
    k2 = qkv.k_int8.reshape(-1, d)
    v2 = qkv.v_fp8.reshape(-1, qkv.v_fp8.shape[-1])
    if any(t.data_ptr() % 16 for t in (q2, k2, v2)):
        raise RuntimeError("use_tma needs 16-byte aligned quantized tensors")
    rows = max(q2.shape[0] + cfg.block_m, k2.shape[0], v2.shape[0])
    if rows >= _TMA_MAX_ROWS:
        raise RuntimeError(f"use_tma needs fewer than 2**31 rows per 2-D view (int32 "
                           f"coordinates); these inputs have {rows}: use a config without TMA")
    return (
        _TensorDescriptor(q2, list(q2.shape), [d, 1], [cfg.block_m, d]),
        _TensorDescriptor(k2, list(k2.shape), [d, 1], [cfg.block_n, d]),
        _TensorDescriptor(v2, list(v2.shape), [v2.shape[1], 1], [d, cfg.block_n]),
    )


def sage_attention_quantized(
    qkv: QuantizedQKV,
    out: torch.Tensor,
    *,
    layout: str,
    scale: float,
    key_lengths: torch.Tensor | None = None,
    return_lse: bool = False,
    config: SageConfig | None = None,
):
    """Run the attention kernel on already-quantized inputs, writing ``out``.

    ``out``: ``[B, Hq, Sq, D]`` (``bhsd``) or ``[B, Sq, Hq, D]`` (``bshd``),
    float16/bfloat16 (float32 under the interpreter), last dim contiguous.
    ``config.block_n`` must equal ``qkv.block_n``. Returns ``out`` or
    ``(out, lse)`` (float32 ``[B, Hq, Sq]``). ``qkv`` built by hand must keep the
    invariants :class:`~.reference.QuantizedQKV` lists (zero padding rows, V's
    scale floor): they are not checked here, which would cost a device sync.
    """
    batch, hq, sq, d = qkv.q_int8.shape
    hkv, skv_pad = qkv.k_int8.shape[1], qkv.k_int8.shape[2]
    cfg = config or default_config(d, out.device)
    if cfg.block_n != qkv.block_n:
        raise ValueError(f"config.block_n ({cfg.block_n}) must equal the quantization block ({qkv.block_n})")
    if qkv.v_permuted != (cfg.kernel == "cuda_sm90"):
        raise ValueError(f"the {cfg.kernel} kernel reads V^T with its keys "
                         f"{'permuted' if cfg.kernel == 'cuda_sm90' else 'in natural order'}: "
                         f"quantize with permute_v={cfg.kernel == 'cuda_sm90'}")
    lse = torch.empty((batch, hq, sq), dtype=torch.float32, device=out.device) if return_lse else None
    if key_lengths is not None:
        key_lengths = key_lengths.to(device=out.device, dtype=torch.int32).contiguous()
    # Launched as a programmatic dependent of the kernel before it (the quantizer's, in
    # sage_attention_forward; omni_kernels._launch): it waits for that grid before any read.
    pdl = programmatic_launch_enabled(out.device)
    if cfg.kernel == "cuda_sm90":
        out4 = out if layout == "bhsd" else out.transpose(1, 2)  # the op takes a [B, H, S, D] view
        torch.ops.omni_kernels.sage_attention_sm90(
            qkv.q_int8, qkv.q_scale, qkv.q_kmean, qkv.k_int8, qkv.k_scale, qkv.v_fp8, qkv.v_scale,
            key_lengths, qkv.seq_kv, float(scale), out4, lse, cfg.kv_splits, pdl,
        )
        return (out, lse) if return_lse else out
    use_tma = bool(cfg.use_tma)
    q_desc, k_desc, v_desc = _tma_descriptors(qkv, cfg) if use_tma else (None, None, None)
    num_m_blocks = cdiv(sq, cfg.block_m)
    sob, soh, som = bhs_strides(out, layout)
    if batch * hq * sq > 0:
        _sage_fwd_kernel[(num_m_blocks * batch * hq,)](
            qkv.q_int8, qkv.q_scale, qkv.q_kmean, qkv.k_int8, qkv.k_scale, qkv.v_fp8, qkv.v_scale, out,
            lse if lse is not None else out, key_lengths if key_lengths is not None else out,
            q_desc, k_desc, v_desc,
            sob, soh, som,
            hq, hkv, sq, qkv.seq_kv, skv_pad, num_m_blocks,
            float(scale), float(scale) * LOG2E,
            HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            HAS_KEY_LENGTHS=key_lengths is not None, RETURN_LSE=return_lse, USE_TMA=use_tma,
            EMULATE_FP8=triton_interpreter_enabled(),
            # the interpreter has no warp specialization (the loop is the same)
            WARP_SPECIALIZE=bool(cfg.warp_specialize) and not triton_interpreter_enabled(),
            SCORE_BIAS=bool(cfg.score_bias), USE_PDL=pdl, launch_pdl=pdl,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return (out, lse) if return_lse else out


def sage_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "bhsd",
    scale: float | None = None,
    key_lengths: torch.Tensor | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    config: SageConfig | None = None,
):
    """Quantized attention forward: ``softmax(scale * q k^T) v`` with INT8 ``QK^T``, FP8 ``PV``.

    Args:
        q: ``[B, Hq, Sq, D]`` (``layout="bhsd"``) or ``[B, Sq, Hq, D]`` (``"bshd"``).
        k, v: ``[B, Hkv, Skv, D]`` / ``[B, Skv, Hkv, D]``; ``Hq % Hkv == 0``.
            float16/bfloat16 on CUDA (compute capability >= 8.9), float16/float32
            on CPU under ``TRITON_INTERPRET=1``; last dim contiguous; D 64 or 128.
        scale: positive; default ``1 / sqrt(D)``.
        key_lengths: optional integer ``[B]``: keys ``j >= key_lengths[b]`` are
            masked; a row with no key outputs 0 (lse ``-inf``).
        return_lse: also return the natural-log log-sum-exp, float32 ``[B, Hq, Sq]``.
        out: optional output (q's shape, dtype, device; last dim contiguous).
        config: optional :class:`SageConfig`.

    Returns:
        ``out`` (q's shape and dtype, contiguous in ``layout`` unless given) or
        ``(out, lse)``.

    Raises:
        ValueError: unsupported inputs (the message names the constraint).
        RuntimeError: a GPU without FP8 tensor cores, or no way to run Triton here.
    """
    reason = unsupported_reason(q, k, v, layout)
    if reason is not None:
        raise (RuntimeError if reason.startswith("needs FP8") else ValueError)(
            f"sage_attention_forward: {reason}"
        )
    reason = triton_unavailable_reason(q.device)
    if reason is not None:
        raise RuntimeError(reason)
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if not (math.isfinite(float(scale)) and float(scale) > 0.0):
        raise ValueError(f"scale must be positive and finite; got {scale}")
    batch = q.shape[0]
    if key_lengths is not None and (
        not isinstance(key_lengths, torch.Tensor) or tuple(key_lengths.shape) != (batch,)
        or key_lengths.dtype.is_floating_point or key_lengths.dtype == torch.bool
    ):
        raise ValueError(f"key_lengths must be an integer tensor of shape [{batch}]")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(3) != 1:
        raise ValueError(
            f"out must match q ({tuple(q.shape)}, {q.dtype}, {q.device}) with a contiguous last "
            f"dim; got {tuple(out.shape)}, {out.dtype}, {out.device}, strides {tuple(out.stride())}"
        )
    cfg = config or default_config(d, q.device)
    if cfg.kernel == "cuda_sm90":
        reason = cuda_sm90_unsupported_reason(q.device, d, q.dtype)
        if reason is not None:
            raise RuntimeError(f"sage_attention_forward: {reason}")
    if key_lengths is not None:
        key_lengths = key_lengths.to(device=q.device, dtype=torch.int32).contiguous()
    if cfg.cuda_quantizer:  # raises ValueError naming what the CUDA quantizer cannot take
        qkv = quantize_qkv_cuda(q, k, v, layout=layout, key_lengths=key_lengths, permute_v=True)
    else:
        qkv = quantize_qkv(q, k, v, layout=layout, block_n=cfg.block_n, key_lengths=key_lengths,
                           permute_v=cfg.kernel == "cuda_sm90")
    return sage_attention_quantized(
        qkv, out, layout=layout, scale=float(scale), key_lengths=key_lengths,
        return_lse=return_lse, config=cfg,
    )


__all__ = [
    "CUDA_SM90_CONFIG",
    "HEAD_DIMS",
    "KERNELS",
    "MIN_CAPABILITY",
    "SageConfig",
    "cuda_sm90_unsupported_reason",
    "default_config",
    "sage_attention_forward",
    "sage_attention_quantized",
    "unsupported_reason",
]
