"""Triton kernels that quantize Q, K and V for :mod:`.attention_kernel`.

The math is defined in :mod:`.reference` (:func:`~.reference.quantize_qkv_reference`);
these kernels produce the same bytes. Two launches:

1. :func:`_k_mean_kernel`: K's mean over its strided sample (keys ``0, r, 2r, ...``,
   :func:`~.reference.k_mean_stride`), one program per kv head, in a fixed order
   (deterministic). It reads ~512 keys of each head, not the whole of K.
2. :func:`_qkv_quant_kernel`: one 1-D grid of V programs (one key block: V to
   FP8 e4m3 with one scale per block, written transposed ``[B, Hkv, D, Skv_pad]``
   as the FP8 MMA wants it), then Q programs (``Q_BLOCK`` tokens: INT8 with a
   scale per token, and ``q . k_mean`` from the unquantized q for the
   log-sum-exp), then K programs (one key block: K minus its mean to INT8 with
   one scale per block).

So each of Q, K and V is read once (and K's sample a second time): every scale
is a maximum over what one program loads. No PyTorch
glue kernels between the launches. On Hopper the second launch is a
programmatic dependent of the first (:mod:`omni_kernels._launch`): it starts
while the K mean still runs, its V programs (first in the grid) need nothing of
it, and the Q and K programs wait for it just before they read ``k_mean``.

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

from omni_kernels._launch import gdc_launch_dependents, gdc_wait, programmatic_launch_enabled
from omni_kernels._triton import cdiv, triton_interpreter_enabled
from omni_kernels.attention.quantized.reference import (
    FP8_DTYPE,
    K_MEAN_SAMPLES,
    TINY_AMAX,
    TINY_BOOST,
    V_AMAX_FLOOR,
    V_KEY_GROUP,
    QuantizedQKV,
)
from omni_kernels.attention.triton_flash import bhs_sizes, bhs_strides

# sampled keys per load of the K-mean loop (16 in the interpreter), and its warps: one program a
# kv head is bound by memory latency, so it loads many rows at once
K_MEAN_BLOCK = 256
K_MEAN_WARPS = 8
# Q rows a program, and the codes launch's warps (V, Q and K programs alike): the fastest pair
# of bench/quantized_attention_tune.py's sweep.
Q_BLOCK = 64
CODES_WARPS = 4


# the reference's tiny-group threshold and boost (reference.scale_to_top), as kernel constants
_TINY_AMAX = tl.constexpr(TINY_AMAX)
_TINY_BOOST = tl.constexpr(TINY_BOOST)
_V_AMAX_FLOOR = tl.constexpr(V_AMAX_FLOOR)


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
def _scale_to_top(x, amax, top: tl.constexpr):
    """``x * (top / amax)`` (``amax`` broadcast against ``x``), as the reference's
    :func:`~.reference.scale_to_top`: a group with ``amax < 2^-100`` is first multiplied by
    ``2^100`` (exact), where ``top / amax`` itself would overflow."""
    boost = tl.where(amax < _TINY_AMAX, _TINY_BOOST, 1.0)
    return (x * boost) * _inverse_scale(amax * boost, top)


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
def _k_mean_kernel(
    K, KMEAN, KEY_LENGTHS, stride_kb, stride_kh, stride_kn, num_kv_heads, seq_k,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, SAMPLES: tl.constexpr,
    HAS_KEY_LENGTHS: tl.constexpr, USE_PDL: tl.constexpr,
):
    """``k_mean`` of kv head ``program_id(0)``: the mean of keys ``0, r, 2r, ...`` below its
    length, ``r = max(1, length // SAMPLES) | 1`` (:func:`~.reference.k_mean_stride`)."""
    if USE_PDL:  # the codes kernel may start now: its V programs need nothing of k_mean
        gdc_launch_dependents()
    bh = tl.program_id(0)
    b = (bh // num_kv_heads).to(tl.int64)
    h = (bh % num_kv_heads).to(tl.int64)
    kv_len = seq_k
    if HAS_KEY_LENGTHS:  # keys past a sample's length are padding: keep them out of the mean
        kv_len = tl.minimum(tl.maximum(tl.load(KEY_LENGTHS + b), 0), seq_k)
    stride = tl.maximum(kv_len // SAMPLES, 1) | 1
    count = (kv_len + stride - 1) // stride
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    k_base = K + b * stride_kb + h * stride_kh
    # element-wise accumulator, reduced over the sample axis once after the loop
    ksum_tile = tl.zeros([BLOCK_S, HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, count, BLOCK_S):
        idx = s0 + offs_s
        rows64 = (idx * stride).to(tl.int64)[:, None]
        k = tl.load(k_base + rows64 * stride_kn + offs_d[None, :], mask=(idx < count)[:, None], other=0.0)
        ksum_tile += k.to(tl.float32)
    ksum = tl.sum(ksum_tile, 0)
    n = tl.maximum(count, 1).to(tl.float32)
    # correctly rounded, as the reference's tensor division
    tl.store(KMEAN + bh.to(tl.int64) * HEAD_DIM + offs_d, tl.math.div_rn(ksum, ksum * 0.0 + n))


@triton.jit
def _quant_q_block(
    Q, Q8, QS, KMEAN, QKMEAN, blk, bh,
    stride_qb, stride_qh, stride_qm, num_heads, num_kv_heads, seq_q,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Q rows ``[blk * BLOCK, +BLOCK)`` of head ``bh``: INT8 per token, and ``q . k_mean``."""
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    kv_bh = b * num_kv_heads + h // (num_heads // num_kv_heads)
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < seq_q
    x = tl.load(
        Q + b * stride_qb + h * stride_qh + rows.to(tl.int64)[:, None] * stride_qm + offs_d[None, :],
        mask=ok[:, None], other=0.0,
    ).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    q8 = _round_half_away(_scale_to_top(x, amax[:, None], 127.0))
    row64 = bh.to(tl.int64) * seq_q + rows
    tl.store(Q8 + row64[:, None] * HEAD_DIM + offs_d[None, :], q8, mask=ok[:, None])
    tl.store(QS + row64, tl.math.div_rn(amax, amax * 0.0 + 127.0), mask=ok)
    # q . k_mean from the unquantized q: the LSE's share that K's smoothing took out
    if USE_PDL:  # k_mean is the previous kernel's output
        gdc_wait()
    k_mean = tl.load(KMEAN + kv_bh * HEAD_DIM + offs_d)
    tl.store(QKMEAN + row64, tl.sum(x * k_mean[None, :], 1), mask=ok)


@triton.jit
def _key_block(KEY_LENGTHS, blk, bh, num_kv_heads, seq_k, BLOCK_N: tl.constexpr,
               HAS_KEY_LENGTHS: tl.constexpr):
    """Where key block ``blk`` of kv head ``bh`` lies: ``(bh, b, h)`` as int64, its key
    ``rows`` and the sample's key count (keys from it on are padding: written as 0 and kept
    out of the block scale)."""
    b = (bh // num_kv_heads).to(tl.int64)
    kv_len = seq_k
    if HAS_KEY_LENGTHS:
        kv_len = tl.minimum(tl.maximum(tl.load(KEY_LENGTHS + b), 0), seq_k)
    rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    return bh.to(tl.int64), b, (bh % num_kv_heads).to(tl.int64), rows, kv_len


@triton.jit
def _quant_k_block(
    K, KMEAN, K8, KS, KEY_LENGTHS, blk, bh,
    stride_kb, stride_kh, stride_kn, num_kv_heads, seq_k, seq_k_pad, num_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Key block ``blk`` of kv head ``bh``: K minus its (sampled) mean to INT8, one scale."""
    bh64, b, h, rows, kv_len = _key_block(KEY_LENGTHS, blk, bh, num_kv_heads, seq_k, BLOCK_N,
                                          HAS_KEY_LENGTHS)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = (rows < kv_len)[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    k = tl.load(K + b * stride_kb + h * stride_kh + rows64 * stride_kn + offs_d[None, :],
                mask=ok, other=0.0).to(tl.float32)
    if USE_PDL:  # k_mean is the previous kernel's output (K's own load above may run first)
        gdc_wait()
    kmean = tl.load(KMEAN + bh64 * HEAD_DIM + offs_d)
    kc = tl.where(ok, k - kmean[None, :], 0.0)  # padding rows stay 0
    amax = tl.max(tl.max(tl.abs(kc), 1), 0)
    k8 = _round_half_away(_scale_to_top(kc, amax, 127.0))
    tl.store(K8 + (bh64 * seq_k_pad + rows64) * HEAD_DIM + offs_d[None, :], k8)
    tl.store(KS + bh64 * num_blocks + blk, tl.math.div_rn(amax, amax * 0.0 + 127.0))


@triton.jit
def _quant_v_block(
    V, VT8, VS, KEY_LENGTHS, blk, bh,
    stride_vb, stride_vh, stride_vn, num_kv_heads, seq_k, seq_k_pad, num_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_FP8: tl.constexpr,
    HAS_KEY_LENGTHS: tl.constexpr, PERMUTE_V: tl.constexpr,
):
    """Key block ``blk`` of kv head ``bh``: V^T to FP8 with one scale (``PERMUTE_V``: key
    columns in ``reference.v_key_permutation``'s order). Needs nothing of the K mean."""
    bh64, b, h, rows, kv_len = _key_block(KEY_LENGTHS, blk, bh, num_kv_heads, seq_k, BLOCK_N,
                                          HAS_KEY_LENGTHS)
    offs_d = tl.arange(0, HEAD_DIM)
    # The permutation is applied to the rows loaded, so the stores run along contiguous key
    # columns (the block's maximum does not depend on the order).
    src = rows
    if PERMUTE_V:  # key 16a + r goes to column 16a + 4 ((r // 2) % 4) + 2 (r // 8) + r % 2,
        # so column 16a + c holds key 16a + 8 ((c // 2) % 2) + 2 (c // 4) + c % 2
        c = rows % 16
        src = rows - c + 8 * ((c // 2) % 2) + 2 * (c // 4) + c % 2
    v_ok = (src < kv_len)[:, None]
    v = tl.load(V + b * stride_vb + h * stride_vh + src.to(tl.int64)[:, None] * stride_vn
                + offs_d[None, :], mask=v_ok, other=0.0).to(tl.float32)
    v_amax = tl.max(tl.max(tl.abs(v), 1), 0)
    v_amax = tl.where(v_amax > 0, tl.maximum(v_amax, _V_AMAX_FLOOR), v_amax)  # floor_v_amax
    v8 = fp8_convert(tl.minimum(tl.maximum(_scale_to_top(v, v_amax, 448.0), -448.0), 448.0), EMULATE_FP8)
    vt_ptrs = VT8 + (bh64 * HEAD_DIM + offs_d.to(tl.int64)[:, None]) * seq_k_pad + rows[None, :]
    tl.store(vt_ptrs, tl.trans(v8))
    tl.store(VS + bh64 * num_blocks + blk, tl.math.div_rn(v_amax, v_amax * 0.0 + 448.0))


@triton.jit
def _qkv_quant_kernel(
    Q, Q8, QS, QKMEAN, K, V, KMEAN, K8, KS, VT8, VS, KEY_LENGTHS,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    num_heads, num_kv_heads, seq_q, seq_k, seq_k_pad, num_q_blocks, num_q_programs, num_blocks,
    num_kv_programs,
    HEAD_DIM: tl.constexpr, Q_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    EMULATE_FP8: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr, PERMUTE_V: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program a V key block, a Q block or a K key block (block fastest): the first
    ``num_kv_programs`` (``num_blocks * B * Hkv``) do V, the next ``num_q_programs`` Q, the
    last ``num_kv_programs`` K.

    ``USE_PDL``: launched as a programmatic dependent of :func:`_k_mean_kernel`, which may still
    run. V needs nothing of it, so the V programs go first (the GPU starts programs roughly in
    index order) and the K mean finishes under them; Q and K programs wait for it
    (``gdc_wait``) just before they read ``k_mean``. The attention kernel after this one may
    launch once every program here has started (its CTAs wait for this grid's completion
    before reading the codes)."""
    if USE_PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    if pid < num_kv_programs:
        _quant_v_block(
            V, VT8, VS, KEY_LENGTHS, pid % num_blocks, pid // num_blocks,
            stride_vb, stride_vh, stride_vn, num_kv_heads, seq_k, seq_k_pad, num_blocks,
            HEAD_DIM, BLOCK_N, EMULATE_FP8, HAS_KEY_LENGTHS, PERMUTE_V,
        )
    elif pid < num_kv_programs + num_q_programs:
        pid -= num_kv_programs
        _quant_q_block(
            Q, Q8, QS, KMEAN, QKMEAN, pid % num_q_blocks, pid // num_q_blocks,
            stride_qb, stride_qh, stride_qm, num_heads, num_kv_heads, seq_q,
            HEAD_DIM, Q_BLOCK, USE_PDL,
        )
    else:
        pid -= num_kv_programs + num_q_programs
        _quant_k_block(
            K, KMEAN, K8, KS, KEY_LENGTHS, pid % num_blocks, pid // num_blocks,
            stride_kb, stride_kh, stride_kn, num_kv_heads, seq_k, seq_k_pad, num_blocks,
            HEAD_DIM, BLOCK_N, HAS_KEY_LENGTHS, USE_PDL,
        )


def quantize_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "bhsd",
    block_n: int = 128,
    key_lengths: torch.Tensor | None = None,
    permute_v: bool = False,
) -> QuantizedQKV:
    """Quantize ``q``, ``k``, ``v`` (see :mod:`.reference` for the exact math).

    Args:
        q: ``[B, Hq, Sq, D]`` (``layout="bhsd"``) or ``[B, Sq, Hq, D]`` (``"bshd"``).
        k, v: ``[B, Hkv, Skv, D]`` / ``[B, Skv, Hkv, D]``; float16, bfloat16 or
            float32, last dimension contiguous; ``D`` a power of two >= 16.
        block_n: key block of the K scales; must equal the attention kernel's ``BLOCK_N``.
        key_lengths: optional int32 ``[B]`` on q's device: keys ``j >= key_lengths[b]``
            are padding; they are left out of K's mean and the block scales, and written as 0.
        permute_v: store V^T's key columns in ``reference.v_key_permutation``'s order,
            as the Hopper CUDA kernel reads them (``block_n`` a multiple of 16).

    Returns:
        :class:`~.reference.QuantizedQKV` (contiguous, head-major, K and V
        padded to a multiple of ``block_n`` keys). Deterministic: the same
        inputs give the same bytes.
    """
    batch, hq, sq, d = bhs_sizes(q, layout)
    _, hkv, skv, _ = bhs_sizes(k, layout)
    device = q.device
    if permute_v and block_n % V_KEY_GROUP:
        raise ValueError(f"permute_v needs block_n to be a multiple of {V_KEY_GROUP}; got {block_n}")
    nblk = cdiv(skv, block_n)
    skv_pad = nblk * block_n
    num_kv_bh = batch * hkv
    emulate = triton_interpreter_enabled()
    has_lengths = key_lengths is not None
    pdl = programmatic_launch_enabled(device)

    k_mean = torch.empty((batch, hkv, d), dtype=torch.float32, device=device)
    skb, skh, skn = bhs_strides(k, layout)
    svb, svh, svn = bhs_strides(v, layout)
    if num_kv_bh:
        _k_mean_kernel[(num_kv_bh,)](
            k, k_mean, key_lengths if has_lengths else k_mean, skb, skh, skn, hkv, skv,
            HEAD_DIM=d, BLOCK_S=16 if emulate else K_MEAN_BLOCK, SAMPLES=K_MEAN_SAMPLES,
            HAS_KEY_LENGTHS=has_lengths, USE_PDL=pdl, num_warps=K_MEAN_WARPS,
        )

    q_int8 = torch.empty((batch, hq, sq, d), dtype=torch.int8, device=device)
    q_scale = torch.empty((batch, hq, sq), dtype=torch.float32, device=device)
    q_kmean = torch.empty_like(q_scale)
    k_int8 = torch.empty((batch, hkv, skv_pad, d), dtype=torch.int8, device=device)
    k_scale = torch.empty((batch, hkv, nblk), dtype=torch.float32, device=device)
    v_fp8 = torch.empty((batch, hkv, d, skv_pad), dtype=FP8_DTYPE, device=device)
    v_scale = torch.empty((batch, hkv, nblk), dtype=torch.float32, device=device)
    q_block = 16 if emulate else Q_BLOCK
    num_q_blocks = cdiv(sq, q_block)
    num_q_programs = num_q_blocks * batch * hq
    num_kv_programs = nblk * num_kv_bh
    grid = num_q_programs + 2 * num_kv_programs
    if grid:
        sqb, sqh, sqm = bhs_strides(q, layout)
        _qkv_quant_kernel[(grid,)](
            q, q_int8, q_scale, q_kmean, k, v, k_mean, k_int8, k_scale, v_fp8, v_scale,
            key_lengths if has_lengths else k_mean,
            sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
            hq, hkv, sq, skv, skv_pad, num_q_blocks, num_q_programs, nblk, num_kv_programs,
            HEAD_DIM=d, Q_BLOCK=q_block, BLOCK_N=block_n, EMULATE_FP8=emulate,
            HAS_KEY_LENGTHS=has_lengths, PERMUTE_V=permute_v, USE_PDL=pdl, launch_pdl=pdl,
            num_warps=CODES_WARPS,
        )
    return QuantizedQKV(q_int8, q_scale, k_int8, k_scale, k_mean, v_fp8, v_scale, skv, block_n, q_kmean,
                        permute_v)


__all__ = ["fp8_convert", "quantize_qkv"]
