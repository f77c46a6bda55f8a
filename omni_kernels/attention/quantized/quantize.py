"""Triton kernels that quantize Q, K and V for :mod:`.attention_kernel`.

The math is defined in :mod:`.reference` (:func:`~.reference.quantize_qkv_reference`);
these kernels produce the same bytes. Three launches:

1. :func:`_kv_stats_kernel`: one pass over K and V together: per chunk of
   tokens, the float32 column sums of K and column maxima of ``|V|``
   (``[B*Hkv, chunks, D]`` partials; torch adds the few chunks up). K's mean
   and V's per-channel maximum are reductions over the *whole* sequence that
   the quantization needs first, so K and V are read twice (stats, then
   quantization); Q once.
2. :func:`_q_quant_kernel`: Q to INT8 with one scale per token, and ``q . k_mean``
   per token (float32, for the log-sum-exp).
3. :func:`_kv_quant_kernel`: per key block, K minus its mean to INT8 with one
   scale per block, and V to FP8 e4m3 with its per-channel scale, written
   transposed (``[B, Hkv, D, Skv_pad]``) as the FP8 MMA wants it.

Inputs are read through strides (``bhsd`` or ``bshd``, any strides with the
last dimension contiguous), in float16, bfloat16 or float32.

Triton's interpreter rounds float32 -> float8 wrongly when the rounding carries
into the exponent (127.9 becomes 64), so under ``TRITON_INTERPRET=1`` the
conversion first rounds to the e4m3 grid in float32 (:func:`fp8_convert`,
``EMULATE_FP8``); compiled kernels use the hardware conversion.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_kernels._triton import triton_interpreter_enabled
from omni_kernels.attention.quantized.reference import FP8_DTYPE, FP8_MAX, QuantizedQKV, inverse_scale
from omni_kernels.attention.triton_flash import _bhs_sizes, _bhs_strides

STATS_CHUNK = 2048  # tokens per stats program (Wan 720p: 37 chunks x 40 heads)
Q_BLOCK = 64


@triton.jit
def _round_half_away(x):
    """Round to nearest, ties away from zero, as int8 (``|x| <= 127.5``).

    Not ``trunc(x + 0.5)``: the compiler fuses the product that made ``x`` into
    that add (an fma, one rounding instead of two), which breaks exact ties.
    ``fabs`` stops the fusion, and ``ax - floor(ax)`` is exact.
    """
    ax = tl.abs(x)
    n = tl.floor(ax)
    n = tl.where(ax - n >= 0.5, n + 1.0, n)
    return tl.where(x < 0, -n, n).to(tl.int8)


@triton.jit
def _inverse_scale(amax, top: tl.constexpr):
    """``top / amax`` correctly rounded (as the reference's tensor division), 0 where amax is 0.

    Triton's float32 ``/`` is ``div.full.f32`` (up to 2 ulp off): at a tie
    (``x * inv`` exactly ``n + 0.5``, common with float16/bfloat16 inputs) one
    ulp flips an INT8 code, and a flipped code in an outlier channel of Q moves
    the whole row's scores (its log-sum-exp by ~1e-2).
    """
    safe = tl.where(amax > 0, amax, 1.0)
    return tl.where(amax > 0, tl.math.div_rn(safe * 0.0 + top, safe), 0.0)


@triton.jit
def fp8_convert(x, EMULATE_FP8: tl.constexpr):
    """float32 ``x`` (``|x| <= 448``) to float8e4nv, round to nearest even."""
    if EMULATE_FP8:
        ax = tl.minimum(tl.abs(x), 448.0)
        # spacing of the e4m3 grid at ax: 2**(e - 3) for normals, 2**-9 below 2**-6
        e = tl.floor(tl.math.log2(tl.maximum(ax, 0.015625)))
        ulp = tl.math.exp2(e - 3.0)
        r = ax / ulp
        n = tl.floor(r + 0.5)
        n = tl.where(((n - r) == 0.5) & ((n % 2.0) == 1.0), n - 1.0, n)
        y = tl.where(x < 0, -n * ulp, n * ulp)
        return y.to(tl.float8e4nv)  # exact: y is on the grid
    return x.to(tl.float8e4nv)


@triton.jit
def _kv_stats_kernel(
    K, V, KSUM, VMAX, KEY_LENGTHS,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    num_kv_heads, seq_k, num_chunks,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
    HAS_KEY_LENGTHS: tl.constexpr,
):
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_kv_heads).to(tl.int64)
    if HAS_KEY_LENGTHS:  # keys past a sample's length are padding: keep them out of the stats
        seq_k = tl.minimum(tl.maximum(tl.load(KEY_LENGTHS + b), 0), seq_k)
    h = (bh % num_kv_heads).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    ksum = tl.zeros([HEAD_DIM], dtype=tl.float32)
    vmax = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s0 in range(chunk * CHUNK, tl.minimum(seq_k, chunk * CHUNK + CHUNK), BLOCK_S):
        rows = s0 + offs_s
        ok = (rows < seq_k)[:, None]
        rows64 = rows.to(tl.int64)[:, None]
        k = tl.load(k_base + rows64 * stride_kn + offs_d[None, :], mask=ok, other=0.0)
        v = tl.load(v_base + rows64 * stride_vn + offs_d[None, :], mask=ok, other=0.0)
        ksum += tl.sum(k.to(tl.float32), 0)
        vmax = tl.maximum(vmax, tl.max(tl.abs(v.to(tl.float32)), 0))
    out = (bh.to(tl.int64) * num_chunks + chunk) * HEAD_DIM + offs_d
    tl.store(KSUM + out, ksum)
    tl.store(VMAX + out, vmax)


@triton.jit
def _q_quant_kernel(
    Q, Q8, QS, KMEAN, QKMEAN,
    stride_qb, stride_qh, stride_qm,
    num_heads, num_kv_heads, seq_q,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    kv_bh = b * num_kv_heads + h // (num_heads // num_kv_heads)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < seq_q
    x = tl.load(
        Q + b * stride_qb + h * stride_qh + rows.to(tl.int64)[:, None] * stride_qm + offs_d[None, :],
        mask=ok[:, None], other=0.0,
    ).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    inv = _inverse_scale(amax, 127.0)
    q8 = _round_half_away(x * inv[:, None])
    row64 = bh.to(tl.int64) * seq_q + rows
    tl.store(Q8 + row64[:, None] * HEAD_DIM + offs_d[None, :], q8, mask=ok[:, None])
    tl.store(QS + row64, tl.math.div_rn(amax, amax * 0.0 + 127.0), mask=ok)
    # q . k_mean from the unquantized q: the LSE's share that K's smoothing took out
    k_mean = tl.load(KMEAN + kv_bh * HEAD_DIM + offs_d)
    tl.store(QKMEAN + row64, tl.sum(x * k_mean[None, :], 1), mask=ok)


@triton.jit
def _kv_quant_kernel(
    K, V, KMEAN, VINV, K8, KS, VT8, KEY_LENGTHS,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    num_kv_heads, seq_k, seq_k_pad, num_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_FP8: tl.constexpr,
    HAS_KEY_LENGTHS: tl.constexpr,
):
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    bh64 = bh.to(tl.int64)
    b = (bh // num_kv_heads).to(tl.int64)
    h = (bh % num_kv_heads).to(tl.int64)
    rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_len = seq_k
    if HAS_KEY_LENGTHS:  # padding keys are written as 0 and stay out of the block scale
        kv_len = tl.minimum(tl.maximum(tl.load(KEY_LENGTHS + b), 0), seq_k)
    ok = (rows < kv_len)[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    # ---- K: subtract the mean over tokens, one INT8 scale for the block
    k = tl.load(K + b * stride_kb + h * stride_kh + rows64 * stride_kn + offs_d[None, :],
                mask=ok, other=0.0).to(tl.float32)
    kmean = tl.load(KMEAN + bh64 * HEAD_DIM + offs_d)
    kc = tl.where(ok, k - kmean[None, :], 0.0)  # padding rows stay 0
    amax = tl.max(tl.max(tl.abs(kc), 1), 0)
    inv = _inverse_scale(amax, 127.0)
    k8 = _round_half_away(kc * inv)
    tl.store(K8 + (bh64 * seq_k_pad + rows64) * HEAD_DIM + offs_d[None, :], k8)
    tl.store(KS + bh64 * num_blocks + blk, tl.math.div_rn(amax, amax * 0.0 + 127.0))
    # ---- V: per-channel FP8 scale, stored transposed [D, Skv_pad]
    v = tl.load(V + b * stride_vb + h * stride_vh + rows64 * stride_vn + offs_d[None, :],
                mask=ok, other=0.0).to(tl.float32)
    vinv = tl.load(VINV + bh64 * HEAD_DIM + offs_d)
    v8 = fp8_convert(tl.minimum(tl.maximum(v * vinv[None, :], -448.0), 448.0), EMULATE_FP8)
    vt_ptrs = VT8 + (bh64 * HEAD_DIM + offs_d.to(tl.int64)[:, None]) * seq_k_pad + rows[None, :]
    tl.store(vt_ptrs, tl.trans(v8))


def _key_counts(key_lengths, batch: int, seq_k: int, device) -> torch.Tensor:
    """float32 ``[B, 1, 1]``: the keys each sample's mean is over (at least 1)."""
    if key_lengths is None:
        return torch.full((batch, 1, 1), float(max(seq_k, 1)), device=device)
    return key_lengths.clamp(1, max(seq_k, 1)).to(device=device, dtype=torch.float32).reshape(batch, 1, 1)


def quantize_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "bhsd",
    block_n: int = 128,
    key_lengths: torch.Tensor | None = None,
) -> QuantizedQKV:
    """Quantize ``q``, ``k``, ``v`` (see :mod:`.reference` for the exact math).

    Args:
        q: ``[B, Hq, Sq, D]`` (``layout="bhsd"``) or ``[B, Sq, Hq, D]`` (``"bshd"``).
        k, v: ``[B, Hkv, Skv, D]`` / ``[B, Skv, Hkv, D]``; float16, bfloat16 or
            float32, last dimension contiguous; ``D`` a power of two >= 16.
        block_n: key block of the K scales; must equal the attention kernel's ``BLOCK_N``.
        key_lengths: optional int32 ``[B]`` on q's device: keys ``j >= key_lengths[b]``
            are padding; they are left out of K's mean, V's scales and the K
            block scales, and written as 0.

    Returns:
        :class:`~.reference.QuantizedQKV` (contiguous, head-major, K and V
        padded to a multiple of ``block_n`` keys).
    """
    batch, hq, sq, d = _bhs_sizes(q, layout)
    _, hkv, skv, _ = _bhs_sizes(k, layout)
    device = q.device
    nblk = triton.cdiv(skv, block_n)
    skv_pad = nblk * block_n
    chunks = triton.cdiv(skv, STATS_CHUNK)
    emulate = triton_interpreter_enabled()
    stats_block = 16 if emulate else 64

    ksum = torch.empty((batch * hkv, chunks, d), dtype=torch.float32, device=device)
    vmax = torch.empty_like(ksum)
    skb, skh, skn = _bhs_strides(k, layout)
    svb, svh, svn = _bhs_strides(v, layout)
    _kv_stats_kernel[(chunks, batch * hkv)](
        k, v, ksum, vmax, key_lengths if key_lengths is not None else ksum,
        skb, skh, skn, svb, svh, svn, hkv, skv, chunks,
        HEAD_DIM=d, BLOCK_S=stats_block, CHUNK=STATS_CHUNK,
        HAS_KEY_LENGTHS=key_lengths is not None, num_warps=4,
    )
    k_mean = (ksum.sum(dim=1).reshape(batch, hkv, d) / _key_counts(key_lengths, batch, skv, device))
    v_amax = vmax.amax(dim=1).reshape(batch, hkv, d)
    v_inv = inverse_scale(v_amax, FP8_MAX)

    q_int8 = torch.empty((batch, hq, sq, d), dtype=torch.int8, device=device)
    q_scale = torch.empty((batch, hq, sq), dtype=torch.float32, device=device)
    sqb, sqh, sqm = _bhs_strides(q, layout)
    q_block = 16 if emulate else Q_BLOCK
    q_kmean = torch.empty_like(q_scale)
    _q_quant_kernel[(triton.cdiv(sq, q_block), batch * hq)](
        q, q_int8, q_scale, k_mean, q_kmean, sqb, sqh, sqm, hq, hkv, sq,
        HEAD_DIM=d, BLOCK=q_block, num_warps=4,
    )

    k_int8 = torch.empty((batch, hkv, skv_pad, d), dtype=torch.int8, device=device)
    k_scale = torch.empty((batch, hkv, nblk), dtype=torch.float32, device=device)
    v_fp8 = torch.empty((batch, hkv, d, skv_pad), dtype=FP8_DTYPE, device=device)
    _kv_quant_kernel[(nblk, batch * hkv)](
        k, v, k_mean, v_inv, k_int8, k_scale, v_fp8,
        key_lengths if key_lengths is not None else k_scale,
        skb, skh, skn, svb, svh, svn, hkv, skv, skv_pad, nblk,
        HEAD_DIM=d, BLOCK_N=block_n, EMULATE_FP8=emulate,
        HAS_KEY_LENGTHS=key_lengths is not None, num_warps=8 if block_n >= 128 else 4,
    )
    v_scale = v_amax / torch.full_like(v_amax, FP8_MAX)  # tensor / tensor: correctly rounded on CUDA
    return QuantizedQKV(q_int8, q_scale, k_int8, k_scale, k_mean, v_fp8, v_scale, skv, block_n, q_kmean)


__all__ = ["fp8_convert", "quantize_qkv"]
