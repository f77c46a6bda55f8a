"""PyTorch reference of omni's quantized attention (SageAttention-2 style): the exact math.

It defines, in float32 on any device, what the kernels of :mod:`.quantize` and
:mod:`.attention_kernel` compute. Quantization (:func:`quantize_qkv_reference`), per
``(batch, head)``:

* **Q** per token: ``q_scale[t] = max_d |q[t]| / 127``, ``q_int8 = round(q * 127 / max)``
  (half away from zero; a zero row gets scale 0 and codes 0).
* **K** smoothed, then per block of ``block_n`` keys: ``k_mean`` is the mean over the keys
  ``0, r, 2r, ...`` below the length ``L``, ``r = max(1, L // K_MEAN_SAMPLES) | 1``
  (:func:`k_mean_stride`; odd, so it does not alias with power-of-two widths). Softmax
  ignores the per-row constant ``q . k_mean`` the smoothing removes (the LSE adds it back).
  ``k_scale[j] = max |k - k_mean| / 127`` over block ``j``'s valid keys; padding rows are 0.
* **V** per key block: ``v_scale[j] = max |v| / 448`` (448: the largest e4m3 value; a
  nonzero max is at least ``V_AMAX_FLOOR``), ``v_fp8 = fp8(v * 448 / max)`` (nearest even),
  stored transposed ``[B, H, D, Skv_pad]``: FP8 MMA needs P V's B operand K-major.

Attention (:func:`quantized_attention_reference`): online softmax over key blocks, as the
kernel runs it (P's FP8 rounding depends on each block's running max):

* ``s = (q_int8 . k_int8) * q_scale[i] * k_scale[j] * scale * log2(e)`` (the integer dot
  is exact);
* the running max is shifted by ``log2(448)`` so ``p = 2**(s - m)`` spans FP8's range;
* each block's ``fp8(p) @ v_fp8`` lands in a fresh float32 tile, times ``v_scale[j]``, then
  is added to the accumulator (FP8 MMA keeps ~14 bits: it never sums across blocks; the
  Hopper CUDA kernel's rescaled accumulator differs by float32 rounding only);
* ``out = acc / l`` with ``l`` the sum of the unrounded ``p``; ``lse = (m + log2(l)) * ln 2
  + scale * q . k_mean`` (natural log, with K's mean: shards of keys merge as unquantized
  ones do); rows with no valid key give 0 and ``-inf``.

Every division is correctly rounded (the kernels use ``div_rn``): INT8 codes of
float16/bfloat16 inputs often sit exactly on a rounding tie.
"""

from __future__ import annotations

import dataclasses
import math

import torch

LOG2E = 1.4426950408889634
INT8_MAX = 127.0
FP8_MAX = 448.0
LOG2_FP8_MAX = math.log2(FP8_MAX)
FP8_DTYPE = torch.float8_e4m3fn
#: keys in K's mean sample (about: see :func:`k_mean_stride`)
K_MEAN_SAMPLES = 512


def k_mean_stride(length: int) -> int:
    """The stride ``r`` of K's mean sample for ``length`` keys: ``max(1, length // 512) | 1``.

    The sample is keys ``0, r, 2r, ...`` below ``length``: ``ceil(length / r)`` keys, between
    342 and 1023 from 1024 keys on (every key below that). Odd, so a sample of keys laid out
    with a power-of-two period (a video's frame width, say) does not hit one phase only.
    """
    return max(1, int(length) // K_MEAN_SAMPLES) | 1


def _bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd'; got {layout!r}")
    return x if layout == "bhsd" else x.transpose(1, 2)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, ties away from zero (what ``trunc(x +- 0.5)`` gives)."""
    return torch.where(x >= 0, x + 0.5, x - 0.5).trunc()


def _divide(x: torch.Tensor, top: float) -> torch.Tensor:
    """``x / top``, correctly rounded: tensor by tensor (on CUDA, dividing by a
    Python scalar multiplies by its rounded reciprocal, one ulp off at times)."""
    return x / torch.full_like(x, top)


def inverse_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """``top / amax`` correctly rounded, and 0 where ``amax`` is 0 (an all-zero group stays 0).

    Correct rounding matters: ``x * inverse_scale`` often lands exactly on a
    ``n + 0.5`` tie with float16/bfloat16 inputs, and a one-ulp different
    quotient flips the INT8 code there. (``top / tensor`` in PyTorch is
    ``tensor.reciprocal() * top``: two roundings.)
    """
    safe = torch.where(amax > 0, amax, 1.0)
    return torch.where(amax > 0, torch.full_like(safe, top) / safe, 0.0)


# Below this group maximum, top / amax can overflow float32 (448 / amax does below ~1.3e-36;
# bfloat16 and float32 inputs reach there): such a group is scaled by TINY_BOOST first.
TINY_AMAX = 2.0**-100
TINY_BOOST = 2.0**100

# A nonzero V block maximum is raised to at least this, so every nonzero V block scale is
# >= 2^-30 (exactly 2^-30 for a raised block: its codes are v * 2^30). The Hopper kernel keeps
# P V in units of the latest block scale and rescales at each change; with scales bounded
# below, that accumulator stays finite for any |V| < ~1e20 (and no scale is subnormal).
# What it costs: a V block of max |v| < 448 * 2^-30 ~ 4.2e-7 is scaled by 2^30 instead of by
# 448 / max |v|; its values keep FP8's relative precision down to |v| = 2^-36 (~1.5e-11), and
# below that round with a fixed step of 2^-39 (FP8's subnormal spacing times 2^-30).
V_AMAX_FLOOR = FP8_MAX * 2.0**-30


def floor_v_amax(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, V_AMAX_FLOOR)`` where ``amax > 0``; 0 stays 0 (an all-zero block)."""
    return torch.where(amax > 0, torch.clamp(amax, min=V_AMAX_FLOOR), amax)


def scale_to_top(x: torch.Tensor, amax: torch.Tensor, top: float) -> torch.Tensor:
    """``x * (top / amax)`` (float32; ``amax`` broadcast against ``x``), the quotient correctly
    rounded, 0 where ``amax`` is 0. A group with ``amax < 2^-100`` is first multiplied by
    ``2^100``, ``x`` and ``amax`` alike: exact for powers of two, so its codes are those of the
    same values at a normal magnitude, where ``top / amax`` itself would be inf (and ``0 * inf``
    NaN). Every other group takes the one product, as before."""
    boost = torch.where(amax < TINY_AMAX, TINY_BOOST, 1.0)
    return (x * boost) * inverse_scale(amax * boost, top)


@dataclasses.dataclass
class QuantizedQKV:
    """Quantized attention inputs, all contiguous, head-major.

    Attributes:
        q_int8: int8 ``[B, Hq, Sq, D]``.
        q_scale: float32 ``[B, Hq, Sq]``: ``q ~ q_int8 * q_scale[..., None]``.
        k_int8: int8 ``[B, Hkv, Skv_pad, D]`` of the *smoothed* keys; rows ``>= Skv`` are 0.
        k_scale: float32 ``[B, Hkv, Skv_pad // block_n]``, one per key block.
        k_mean: float32 ``[B, Hkv, D]``: the subtracted mean of K's strided sample.
        q_kmean: float32 ``[B, Hq, Sq]``: ``q . k_mean`` of the *unquantized* q
            (its kv head's mean): what the smoothing took out of row i's scores.
        v_fp8: float8_e4m3fn ``[B, Hkv, D, Skv_pad]`` (transposed); columns ``>= Skv`` are 0.
        v_scale: float32 ``[B, Hkv, Skv_pad // block_n]``, one per key block:
            ``v[t] ~ v_fp8[:, t] * v_scale[t // block_n]``. Each is 0 or at least
            ``V_AMAX_FLOOR / 448`` (2^-30; the quantizers guarantee it): the Hopper CUDA
            kernel keeps its accumulator in units of the latest block's scale and relies on
            that floor to keep the unit changes finite (a smaller scale can give inf/NaN).
        seq_kv: the true key count ``Skv``.
        block_n: the key block of ``k_scale`` (and of the attention kernel).
        v_permuted: ``v_fp8``'s key columns are in :func:`v_key_permutation`'s order
            (the Hopper CUDA kernel's), not natural order.
    """

    q_int8: torch.Tensor
    q_scale: torch.Tensor
    k_int8: torch.Tensor
    k_scale: torch.Tensor
    k_mean: torch.Tensor
    v_fp8: torch.Tensor
    v_scale: torch.Tensor
    seq_kv: int
    block_n: int
    q_kmean: torch.Tensor
    v_permuted: bool = False


V_KEY_GROUP = 16  # the permutation of v_key_permutation repeats every 16 keys


def v_key_permutation(seq_pad: int, device=None) -> torch.Tensor:
    """Key order of a permuted ``v_fp8``: column ``c`` holds key ``perm[c]`` (int64 ``[seq_pad]``).

    Within each group of 16 keys, column ``4t + i`` holds key ``2t + (i % 2) + 8 (i // 2)``
    (``t`` in 0..3, ``i`` in 0..3): ``[0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]``.
    That is the order in which a thread of the Hopper kernel holds P's columns in its
    float32 scores (columns ``8c + 2t`` and ``8c + 2t + 1`` of each 8-column chunk ``c``),
    so it packs its own values into the FP8 MMA's A fragments (4 consecutive columns per
    register) without exchanging them with other threads. ``seq_pad``: a multiple of 16.
    """
    if seq_pad % V_KEY_GROUP:
        raise ValueError(f"seq_pad must be a multiple of {V_KEY_GROUP}; got {seq_pad}")
    col = torch.arange(seq_pad, device=device)
    within = col % V_KEY_GROUP
    t, i = within // 4, within % 4
    return col - within + 2 * t + i % 2 + 8 * (i // 2)


def natural_v(qkv: QuantizedQKV) -> torch.Tensor:
    """``qkv.v_fp8`` with its key columns in natural order (a copy when permuted)."""
    if not qkv.v_permuted:
        return qkv.v_fp8
    perm = v_key_permutation(qkv.v_fp8.shape[-1], qkv.v_fp8.device)
    natural = torch.empty_like(qkv.v_fp8).view(torch.uint8)  # (no float8 indexing kernels)
    natural[..., perm] = qkv.v_fp8.view(torch.uint8)
    return natural.view(qkv.v_fp8.dtype)


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to float8 e4m3 (nearest even, saturating at +-448), as float32."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(torch.float32)


def quantize_qkv_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "bhsd",
    block_n: int = 128,
    key_lengths: torch.Tensor | None = None,
    permute_v: bool = False,
) -> QuantizedQKV:
    """The quantization of :mod:`.quantize` in PyTorch (see the module docstring).

    ``q`` ``[B, Hq, Sq, D]``, ``k``/``v`` ``[B, Hkv, Skv, D]`` in ``layout="bhsd"``
    (``[B, S, H, D]`` for ``"bshd"``), any float dtype; computed in float32.
    ``key_lengths`` (int ``[B]``): keys ``j >= key_lengths[b]`` are padding, set
    to 0 before any statistic (mean over the valid keys only). ``permute_v``: ``v_fp8``'s
    key columns in :func:`v_key_permutation`'s order (``block_n`` a multiple of 16).
    """
    qb = _bhsd(q, layout).to(torch.float32)
    kb = _bhsd(k, layout).to(torch.float32)
    vb = _bhsd(v, layout).to(torch.float32)
    batch, hkv, skv, d = kb.shape
    valid = torch.ones((batch, 1, skv, 1), dtype=torch.bool, device=kb.device)
    if key_lengths is not None:
        lengths = key_lengths.to(device=kb.device, dtype=torch.int64).clamp(0, skv)
        valid = (torch.arange(skv, device=kb.device)[None, :] < lengths[:, None])[:, None, :, None]
        # where, not a product: -x * 0 is -0.0, whose FP8 byte (0x80) is not the kernels' 0x00
        kb, vb = torch.where(valid, kb, 0.0), torch.where(valid, vb, 0.0)
    nblk = -(-skv // block_n)
    pad = nblk * block_n - skv

    q_amax = qb.abs().amax(dim=-1)
    q_int8 = round_half_away(scale_to_top(qb, q_amax[..., None], INT8_MAX)).to(torch.int8)
    q_scale = _divide(q_amax, INT8_MAX)

    # K's mean over its strided sample, per sample of the batch (lengths differ)
    lengths_list = lengths.tolist() if key_lengths is not None else [skv] * batch
    k_mean = torch.empty((batch, hkv, d), dtype=torch.float32, device=kb.device)
    for b, length in enumerate(lengths_list):
        rows = kb[b, :, 0:length:k_mean_stride(length)]
        k_mean[b] = _divide(rows.sum(dim=1), float(max(rows.shape[1], 1)))
    kc = torch.nn.functional.pad(torch.where(valid, kb - k_mean[:, :, None], 0.0), (0, 0, 0, pad))
    blocks = kc.reshape(batch, hkv, nblk, block_n, d)
    k_amax = blocks.abs().amax(dim=(-1, -2))
    k_int8 = round_half_away(scale_to_top(blocks, k_amax[..., None, None], INT8_MAX))
    k_int8 = k_int8.to(torch.int8).reshape(batch, hkv, nblk * block_n, d)
    k_scale = _divide(k_amax, INT8_MAX)

    v_blocks = torch.nn.functional.pad(vb, (0, 0, 0, pad)).reshape(batch, hkv, nblk, block_n, d)
    v_amax = floor_v_amax(v_blocks.abs().amax(dim=(-1, -2)))
    v_scaled = scale_to_top(v_blocks, v_amax[..., None, None], FP8_MAX)
    v_fp8 = v_scaled.clamp(-FP8_MAX, FP8_MAX).reshape(batch, hkv, nblk * block_n, d)
    v_fp8 = v_fp8.to(FP8_DTYPE).transpose(-1, -2)
    if permute_v:
        perm = v_key_permutation(v_fp8.shape[-1], v_fp8.device)
        v_fp8 = v_fp8.view(torch.uint8)[..., perm].view(FP8_DTYPE)
    v_fp8 = v_fp8.contiguous()
    v_scale = _divide(v_amax, FP8_MAX)
    q_kmean = (qb * k_mean.repeat_interleave(qb.shape[1] // hkv, dim=1)[:, :, None, :]).sum(dim=-1)
    return QuantizedQKV(
        q_int8.contiguous(), q_scale.contiguous(), k_int8.contiguous(), k_scale.contiguous(),
        k_mean.contiguous(), v_fp8, v_scale.contiguous(), skv, block_n, q_kmean.contiguous(),
        permute_v,
    )


def dequantize_qkv(qkv: QuantizedQKV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 bhsd ``(q, k_smoothed, v)`` as the quantized tensors represent them (padding dropped)."""
    q = qkv.q_int8.float() * qkv.q_scale[..., None]
    scale = qkv.k_scale.repeat_interleave(qkv.block_n, dim=-1)[..., None]
    k = (qkv.k_int8.float() * scale)[:, :, : qkv.seq_kv]
    vscale = qkv.v_scale.repeat_interleave(qkv.block_n, dim=-1)[..., None, :]
    v = (natural_v(qkv).float() * vscale).transpose(-1, -2)[:, :, : qkv.seq_kv]
    return q, k, v


#: quantized_attention_reference's row_sums values.
ROW_SUMS = ("float32", "fp8")


def quantized_attention_reference(
    qkv: QuantizedQKV,
    *,
    scale: float,
    key_lengths: torch.Tensor | None = None,
    return_lse: bool = False,
    row_sums: str = "float32",
):
    """Attention on quantized inputs, blockwise as the kernel computes it.

    Returns float32 ``out`` ``[B, Hq, Sq, D]`` (bhsd), or ``(out, lse)`` with
    ``lse`` float32 ``[B, Hq, Sq]`` (natural log). GQA: query head ``h`` reads
    kv head ``h // (Hq // Hkv)``. ``key_lengths`` (int ``[B]``): keys
    ``j >= key_lengths[b]`` are masked; a row without keys gives 0 / ``-inf``.

    ``row_sums``: what the softmax denominator sums. ``"float32"`` (the Triton
    kernel): the float32 probabilities. ``"fp8"`` (the Hopper CUDA kernel, whose
    P V MMA also multiplies P by a row of ones): the FP8-rounded probabilities
    that multiply V, so each output row is an exact convex combination of V's rows.
    """
    if row_sums not in ROW_SUMS:
        raise ValueError(f"row_sums must be one of {ROW_SUMS}; got {row_sums!r}")
    q8, qs = qkv.q_int8, qkv.q_scale
    batch, hq, sq, d = q8.shape
    hkv = qkv.k_int8.shape[1]
    group = hq // hkv
    k8 = qkv.k_int8.repeat_interleave(group, dim=1).to(torch.float32)
    ks = qkv.k_scale.repeat_interleave(group, dim=1)
    vt = natural_v(qkv).repeat_interleave(group, dim=1).to(torch.float32)
    vs = qkv.v_scale.repeat_interleave(group, dim=1)
    qf = q8.to(torch.float32)
    qk_scale = torch.tensor(scale * LOG2E, dtype=torch.float32)
    device = q8.device
    lengths = torch.full((batch,), qkv.seq_kv, dtype=torch.int64, device=device)
    if key_lengths is not None:
        lengths = key_lengths.to(device=device, dtype=torch.int64).clamp(0, qkv.seq_kv)

    m = torch.full((batch, hq, sq), -1.0e30, dtype=torch.float32, device=device)
    l_sum = torch.zeros((batch, hq, sq), dtype=torch.float32, device=device)
    acc = torch.zeros((batch, hq, sq, d), dtype=torch.float32, device=device)
    bn = qkv.block_n
    for j in range(-(-qkv.seq_kv // bn)):
        cols = torch.arange(j * bn, (j + 1) * bn, device=device)
        s_int = qf @ k8[:, :, j * bn:(j + 1) * bn].transpose(-1, -2)  # exact in float32
        row = qs * (ks[:, :, j] * qk_scale)[..., None]
        s = s_int * row[..., None]
        valid = cols[None, :] < lengths[:, None]  # [B, bn]
        s = torch.where(valid[:, None, None, :], s, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1) - LOG2_FP8_MAX)
        p = torch.exp2(s - m_new[..., None])
        alpha = torch.exp2(m - m_new)
        p8 = fp8_round(p)
        l_sum = l_sum * alpha + (p if row_sums == "float32" else p8).sum(dim=-1)
        pv = p8 @ vt[:, :, :, j * bn:(j + 1) * bn].transpose(-1, -2)
        acc = acc * alpha[..., None] + pv * vs[:, :, j, None, None]
        m = m_new
    has = l_sum > 0
    safe = torch.where(has, l_sum, 1.0)
    out = acc / safe[..., None]
    if not return_lse:
        return out
    # K's mean was subtracted before the scores, shifting row i's log-sum-exp
    # by scale * q_i . k_mean (softmax does not see it, an LSE does): add it back
    lse = torch.where(has, (m + torch.log2(safe)) * math.log(2.0) + qkv.q_kmean * scale, float("-inf"))
    return out, lse


def sage_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "bhsd",
    scale: float | None = None,
    key_lengths: torch.Tensor | None = None,
    block_n: int = 128,
) -> torch.Tensor:
    """Quantize then attend: the whole quantized forward, float32 out in ``layout``."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    qkv = quantize_qkv_reference(q, k, v, layout=layout, block_n=block_n, key_lengths=key_lengths)
    out = quantized_attention_reference(qkv, scale=scale, key_lengths=key_lengths)
    return out if layout == "bhsd" else out.transpose(1, 2)


def dit_like_qkv(gen: torch.Generator, shape, dtype: torch.dtype, device="cpu"):
    """Test inputs ``(q, k, v)`` of ``shape`` (``[B, H, S, D]``) shaped like DiT projections.

    q: a few channels 3-6x larger than the rest (zero-mean, as after a QK-RMSNorm
    with uneven weights); k: the same, plus a large per-channel bias on a few
    channels (10-30, shared by all tokens: the outlier SageAttention smooths
    away); v: a per-channel mean (std 1) shared by the tokens.
    """
    d = shape[-1]

    def randn(*s):
        return torch.randn(*s, generator=gen, device=device)

    def outliers(x):
        ch = torch.randperm(d, generator=gen, device=device)[:3]
        x[..., ch] *= 3.0 + 3.0 * torch.rand(3, generator=gen, device=device)
        return x

    bias = torch.zeros(d, device=device)
    ch = torch.randperm(d, generator=gen, device=device)[:4]
    bias[ch] = (10.0 + 20.0 * torch.rand(4, generator=gen, device=device)) * torch.sign(randn(4))
    q = outliers(randn(*shape))
    k = outliers(randn(*shape)) + bias
    v = randn(*shape) + randn(d)
    return q.to(dtype), k.to(dtype), v.to(dtype)


__all__ = [
    "FP8_MAX",
    "INT8_MAX",
    "K_MEAN_SAMPLES",
    "QuantizedQKV",
    "dequantize_qkv",
    "dit_like_qkv",
    "fp8_round",
    "inverse_scale",
    "k_mean_stride",
    "natural_v",
    "quantize_qkv_reference",
    "quantized_attention_reference",
    "round_half_away",
    "sage_attention_reference",
    "scale_to_top",
    "v_key_permutation",
]
