"""Tests of omni's quantized attention (INT8 Q K^T, FP8 P V): ``omni_sage``.

CPU part (CI, Triton's interpreter):

* the quantization kernels against :func:`quantize_qkv_reference`: exact
  expected scales and codes on hand-made inputs, and the same bytes on random
  float16/float32 inputs in both layouts with a ragged last key block;
* the attention kernel against the blockwise reference
  (:func:`quantized_attention_reference`, the kernel's exact math): both
  layouts, GQA, key lengths (an empty sample too), log-sum-exp, outputs
  poisoned with NaN first. The interpreter runs the real ``int8 x int8 -> int32``
  and ``float8 x float8`` dots; only its float32 -> float8 rounding is replaced
  (it does not carry into the exponent, see :mod:`...quantized.quantize`);
* the reference's accuracy against float32 attention on DiT-like inputs;
* the ``omni_sage`` registry declaration and its errors.

GPU part (``-m gpu``): the compiled kernel at the issue's shapes against float32
(cosine per row, relative L2), beside sageattention's figures on the same inputs.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from omni_kernels.attention import attention, get_backend, select_backend
from omni_kernels.attention.quantized.attention_kernel import (
    CUDA_SM90_CONFIG,
    SageConfig,
    cuda_sm90_unsupported_reason,
    default_config,
    sage_attention_forward,
    sage_attention_quantized,
)
from omni_kernels.attention.quantized.quantize import quantize_qkv
from omni_kernels.attention.quantized.reference import (
    FP8_DTYPE,
    V_AMAX_FLOOR,
    dequantize_qkv,
    dit_like_qkv,
    k_mean_stride,
    natural_v,
    quantize_qkv_reference,
    quantized_attention_reference,
    sage_attention_reference,
    v_key_permutation,
)

# --------------------------------------------------------------------------- inputs


def _shape(layout, b, h, s, d):
    return (b, h, s, d) if layout == "bhsd" else (b, s, h, d)


def _exact(q, k, v, scale=None):
    """float32 attention, ``[B, H, S, D]`` inputs (GQA expanded)."""
    q, k, v = (t.float() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v


def _row_cosine(out, ref):
    return torch.nn.functional.cosine_similarity(out.double(), ref.double(), dim=-1).mean().item()


def _assert_same_bytes(got: torch.Tensor, ref: torch.Tensor, name: str):
    """Bitwise equality (so -0.0 vs +0.0 counts), naming the first mismatch:
    index, both bit patterns and values, and how many differ."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, f"{name}: {got.shape} {got.dtype} vs {ref.shape} {ref.dtype}"
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    gb, rb = got.view(bits), ref.view(bits)
    bad = (gb != rb).nonzero()
    if len(bad):
        i = tuple(bad[0].tolist())
        width = 2 * got.element_size()
        raise AssertionError(
            f"{name}: {len(bad)} of {gb.numel()} elements differ bitwise; first at {i}: "
            f"got 0x{gb[i].item() & (2 ** (4 * width) - 1):0{width}x} ({got[i].float().item()!r}), "
            f"reference 0x{rb[i].item() & (2 ** (4 * width) - 1):0{width}x} ({ref[i].float().item()!r})"
        )


# --------------------------------------------------------------------------- CPU: quantization


def test_quantize_exact_scales():
    """Hand-made inputs whose scales and codes are known in closed form."""
    d = 16
    # q: token 0 max |.| 2.54 -> scale 0.02, codes = x / 0.02; token 1 all zero -> scale 0
    q = torch.zeros(1, 1, 2, d)
    q[0, 0, 0, :4] = torch.tensor([2.54, -1.27, 0.01, 0.03])  # 0.5 and 1.5 steps: ties away from 0
    # k: 20 tokens (two key blocks of 16, the second ragged); column 0 alternates 3 / 1
    # (mean 2) -> centered +-1; column 1 is the constant 5 (mean 5) -> 0; column 2 is 4 on
    # token 17 only (mean 0.2) -> block 1 max 3.8
    k = torch.zeros(1, 1, 20, d)
    k[0, 0, :, 0] = torch.tensor([3.0, 1.0] * 10)
    k[0, 0, :, 1] = 5.0
    k[0, 0, 17, 2] = 4.0
    # v: one scale per key block over all channels: block 0 max |.| 7 (-> scale 7/448, channel
    # 1's 0.25 in its units); block 1 all zero (-> scale 0, codes 0)
    v = torch.zeros(1, 1, 20, d)
    v[0, 0, :16, 0] = torch.linspace(-7.0, 3.5, 16)
    v[0, 0, :16, 1] = 0.25
    for impl in (quantize_qkv, quantize_qkv_reference):
        qkv = impl(q, k, v, block_n=16)
        assert qkv.q_scale[0, 0].tolist() == [pytest.approx(2.54 / 127, rel=1e-7), 0.0]
        assert qkv.q_int8[0, 0, 0, :4].tolist() == [127, -64, 1, 2]  # -63.5 -> -64, 0.5 -> 1, 1.5 -> 2
        assert not qkv.q_int8[0, 0, 1].any()
        assert torch.allclose(qkv.k_mean[0, 0, :3], torch.tensor([2.0, 5.0, 0.2]), rtol=1e-6)
        assert qkv.k_scale[0, 0, 0].item() == pytest.approx(1.0 / 127, rel=1e-6)
        assert qkv.k_scale[0, 0, 1].item() == pytest.approx(3.8 / 127, rel=1e-6)
        assert qkv.k_int8[0, 0, :16, 0].tolist() == [127, -127] * 8
        assert not qkv.k_int8[0, 0, :, 1].any()
        assert not qkv.k_int8[0, 0, 20:].any(), "padding keys must be 0"
        assert qkv.v_scale.shape == (1, 1, 2)
        assert qkv.v_scale[0, 0].tolist() == [pytest.approx(7.0 / 448, rel=1e-7), 0.0]
        assert qkv.v_fp8.shape == (1, 1, d, 32)
        assert qkv.v_fp8[0, 0, 0, 0].float().item() == -448.0
        assert qkv.v_fp8[0, 0, 1, :16].float().tolist() == [16.0] * 16  # 0.25 * 448 / 7
        assert not qkv.v_fp8[0, 0, :, 16:].float().any(), "a zero block has codes 0"
        assert not qkv.v_fp8[0, 0, :, 20:].float().any(), "padding keys must be 0"


def test_k_mean_is_the_mean_of_a_strided_sample():
    """From 1024 keys on, K's mean comes from keys 0, r, 2r, ... (r = max(1, L // 512) | 1):
    key t holds t in channel 0, so the mean is r * (n - 1) / 2 in closed form. With key
    lengths each sample uses its own length's stride."""
    d = 16
    skv = 2100
    t = torch.arange(skv, dtype=torch.float32)
    k = torch.zeros(2, 1, skv, d)
    k[:, 0, :, 0] = t
    k[:, 0, :, 1] = (t % 5 == 0).float()  # 1 exactly on the sampled keys of stride 5
    q = torch.randn(2, 1, 3, d)
    v = torch.randn(2, 1, skv, d)
    lengths = torch.tensor([2100, 1030])
    # 2100 // 512 = 4 -> r = 5, 420 keys (0..2095); 1030 // 512 = 2 -> r = 3, 344 keys (0..1029)
    assert [k_mean_stride(n) for n in (0, 1, 1023, 1024, 1030, 2100, 4608, 75600)] == [1, 1, 1, 3, 3, 5, 9, 147]
    for impl in (quantize_qkv, quantize_qkv_reference):
        qkv = impl(q, k, v, block_n=16, key_lengths=lengths)
        assert qkv.k_mean[0, 0, 0].item() == 5 * 419 / 2, impl.__name__
        assert qkv.k_mean[0, 0, 1].item() == 1.0, impl.__name__
        assert qkv.k_mean[1, 0, 0].item() == 3 * 343 / 2, impl.__name__
        # below 1024 keys the sample is every key
        short = impl(q, k[:, :, :1000], v[:, :, :1000], block_n=16)
        assert short.k_mean[0, 0, 0].item() == 999 / 2, impl.__name__
        # q . k_mean (the LSE's correction) uses the same sampled mean
        torch.testing.assert_close(qkv.q_kmean, (q * qkv.k_mean[:, :, None]).sum(-1), rtol=1e-5, atol=1e-3)


def test_v_blocks_of_mixed_magnitude(inputs, rel_err):
    """One V scale per key block: blocks of magnitude 1e-4, 1, 0 and 1e3 each keep FP8's
    relative precision (a scale per channel over all tokens would flush the small block to
    zero), and the kernel, whose accumulator changes units from block to block, matches the
    blockwise reference (a block of zeros keeps the unit; a row never sees units mix)."""
    b, h, sq, d, bn = 1, 2, 24, 64, 16
    skv = 4 * bn + 5  # four full blocks and a ragged fifth
    q = inputs.activations((b, h, sq, d), torch.float32)
    k = inputs.activations((b, h, skv, d), torch.float32)
    v = inputs.activations((b, h, skv, d), torch.float32, outlier_channels=0)
    for block, magnitude in enumerate((1e-4, 1.0, 0.0, 1e3, 1.0)):
        v[:, :, block * bn:(block + 1) * bn] *= magnitude
    for impl in (quantize_qkv, quantize_qkv_reference):
        qkv = impl(q, k, v, block_n=bn)
        assert qkv.v_scale.shape == (b, h, 5)
        assert (qkv.v_scale[:, :, 2] == 0).all() and (qkv.v_scale[:, :, [0, 1, 3, 4]] > 0).all()
        vd = dequantize_qkv(qkv)[2]
        for block in (0, 1, 3, 4):
            rows = slice(block * bn, min((block + 1) * bn, skv))
            assert rel_err(vd[:, :, rows], v[:, :, rows]) <= 4e-2, (impl.__name__, block)
    ref = quantize_qkv_reference(q, k, v, block_n=bn)
    out, lse = sage_attention_forward(q, k, v, config=SageConfig(16, bn, 4, 1), return_lse=True)
    ref_out, ref_lse = quantized_attention_reference(ref, scale=1 / math.sqrt(d), return_lse=True)
    assert rel_err(out, ref_out) <= 1e-5
    assert (lse - ref_lse).abs().max().item() <= 1e-4


def test_tiny_groups_quantize_as_at_normal_magnitude(inputs, rel_err):
    """A group (Q row or K block) whose max |x| is below 2^-100, where ``top / amax``
    overflows float32 (448 / amax under ~1.3e-36; bfloat16 and float32 inputs get there) and
    ``0 * inf`` is NaN: its codes are those of the same values times 2^100, an exact scaling,
    in the Triton kernel and the reference alike; no NaN reaches the attention. (A tiny V
    block takes the V floor instead: test_v_block_maximum_floor.)"""
    b, h, sq, skv, d, bn = 1, 2, 20, 48, 64, 16
    boost = 2.0**100
    q = inputs.activations((b, h, sq, d), torch.float32)
    k = inputs.activations((b, h, skv, d), torch.float32)
    v = inputs.activations((b, h, skv, d), torch.float32, outlier_channels=0)
    q[:, :, :4] *= 1e-38  # tiny rows, subnormal values among them
    q[:, :, 4] *= 1e-44   # a row of subnormals only
    q[:, :, 0, :3] = 0.0
    v[:, :, bn:2 * bn] *= 1e-38  # a tiny key block, with zeros in it
    v[:, :, bn, :5] = 0.0
    q_big = q.clone()
    q_big[:, :, :5] *= boost
    big = quantize_qkv_reference(q_big, k, v, block_n=bn)
    for impl in (quantize_qkv_reference, quantize_qkv):
        qkv = impl(q, k, v, block_n=bn)
        assert torch.equal(qkv.q_int8, big.q_int8), impl.__name__
        _assert_same_bytes(qkv.v_fp8, big.v_fp8, f"{impl.__name__}: v_fp8")
        assert not qkv.v_fp8.float().isnan().any()
        assert (qkv.q_scale[:, :, :5] > 0).all() and (qkv.v_scale[:, :, 1] > 0).all()
    out, lse = sage_attention_forward(q, k, v, config=SageConfig(16, bn, 4, 1), return_lse=True)
    ref = quantize_qkv_reference(q, k, v, block_n=bn)
    ref_out, ref_lse = quantized_attention_reference(ref, scale=1 / math.sqrt(d), return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_err(out, ref_out) <= 1e-5
    assert (lse - ref_lse).abs().max().item() <= 1e-4
    # K all tiny (its mean and the centred blocks too): finite codes within a half step
    k_tiny = k * 1e-38
    for impl in (quantize_qkv_reference, quantize_qkv):
        qkv = impl(q, k_tiny, v, block_n=bn)
        assert (qkv.k_scale > 0).all() and qkv.k_int8.abs().max().item() > 100, impl.__name__
        kd = dequantize_qkv(qkv)[1][:, :, :skv] + qkv.k_mean[:, :, None]
        assert ((kd - k_tiny).abs() <= 0.51 * qkv.k_scale.amax() + 1e-45).all(), impl.__name__


def test_v_block_maximum_floor(inputs):
    """A nonzero V block maximum below V_AMAX_FLOOR (448 * 2^-30) is raised to it: the block's
    scale is exactly 2^-30 and its codes are fp8(v * 2^30) (an exact product); blocks above the
    floor keep scale max|v| / 448, an all-zero block keeps scale 0, in the Triton kernel and the
    reference alike (the Hopper kernel's accumulator relies on the bound)."""
    b, h, skv, d, bn = 1, 2, 64, 32, 16
    q = inputs.activations((b, h, 8, d), torch.float32)
    k = inputs.activations((b, h, skv, d), torch.float32)
    v = inputs.activations((b, h, skv, d), torch.float32)
    v[:, :, bn:2 * bn] *= 1e-7 / v[:, :, bn:2 * bn].abs().amax()  # max |v| 1e-7 < 4.2e-7
    v[:, :, 2 * bn:3 * bn] = 0.0
    v[:, :, 3 * bn:] *= 1e-38  # tiny (subnormal values among them)
    expected_scale = v.reshape(b, h, skv // bn, bn * d).abs().amax(-1) / 448.0
    expected_scale[:, :, 1] = 2.0**-30
    expected_scale[:, :, 3] = 2.0**-30
    floored = torch.cat([v[:, :, bn:2 * bn], v[:, :, 3 * bn:]], 2) * 2.0**30
    for impl in (quantize_qkv_reference, quantize_qkv):
        qkv = impl(q, k, v, block_n=bn)
        assert torch.equal(qkv.v_scale, expected_scale), impl.__name__
        codes = qkv.v_fp8.transpose(-1, -2).float()  # [B, H, Skv, D]
        got = torch.cat([codes[:, :, bn:2 * bn], codes[:, :, 3 * bn:]], 2)
        assert torch.equal(got, floored.to(FP8_DTYPE).float()), impl.__name__
        assert got.abs().amax() > 1.0 and (codes[:, :, 2 * bn:3 * bn] == 0).all(), impl.__name__
    assert V_AMAX_FLOOR == 448.0 * 2.0**-30


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout,lengths", [("bhsd", None), ("bshd", None), ("bhsd", (45, 20))])
def test_quantize_matches_reference(inputs, dtype, layout, lengths):
    b, hq, hkv, sq, skv, d = 2, 4, 2, 23, 45, 64
    q = inputs.activations(_shape(layout, b, hq, sq, d), dtype)
    k = inputs.activations(_shape(layout, b, hkv, skv, d), dtype) + 2.0
    v = inputs.activations(_shape(layout, b, hkv, skv, d), dtype, outlier_channels=0)
    if lengths is not None:  # padding keys of both signs: written as +0, in kernel and reference
        lengths = torch.tensor(lengths)
    got = quantize_qkv(q, k, v, layout=layout, block_n=16, key_lengths=lengths)
    ref = quantize_qkv_reference(q, k, v, layout=layout, block_n=16, key_lengths=lengths)
    for name in ("q_scale", "k_scale", "v_scale"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-6, atol=0)
    # the mean's float32 sum runs in another order: a float32 sum of n terms can differ
    # by up to n * 2^-24 * max|k| between orders
    torch.testing.assert_close(got.k_mean, ref.k_mean, rtol=0, atol=skv * 2.0**-24 * k.float().abs().max().item())
    # the mean is summed in another order: a code may sit one step off at a tie
    assert torch.equal(got.q_int8, ref.q_int8)
    assert (got.k_int8.int() - ref.k_int8.int()).abs().max().item() <= 1
    _assert_same_bytes(got.v_fp8, ref.v_fp8, "v_fp8")
    if lengths is not None:
        return
    # dequantized values are close to the inputs (the K mean added back)
    qd, kd, vd = dequantize_qkv(got)
    bh = (lambda t: t) if layout == "bhsd" else (lambda t: t.transpose(1, 2))
    assert ((qd - bh(q).float()).abs() <= got.q_scale[..., None] / 2 * 1.0001).all()
    kmean = got.k_mean[:, :, None]
    assert ((kd + kmean - bh(k).float()).abs() <= 0.51 * got.k_scale.amax() + 1e-6).all()
    assert ((vd - bh(v).float()).abs() <= bh(v).float().abs() / 16 + 2.0**-9 * got.v_scale.amax()).all()


def test_v_key_permutation_order():
    """Column 4t + i of each 16-key group holds key 2t + i % 2 + 8 (i // 2): the order of the
    Hopper kernel's P fragments."""
    perm = v_key_permutation(48).tolist()
    group = [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    assert perm == group + [16 + x for x in group] + [32 + x for x in group]
    with pytest.raises(ValueError, match="multiple of 16"):
        v_key_permutation(40)


@pytest.mark.parametrize("lengths", [None, (45, 20)])
def test_quantize_permuted_v(inputs, lengths):
    """permute_v=True: the reference's bytes, and the unpermuted V^T once the order is undone;
    Q and K are untouched."""
    b, hq, hkv, sq, skv, d = 2, 2, 2, 9, 45, 64
    q = inputs.activations((b, hq, sq, d), torch.float16)
    k = inputs.activations((b, hkv, skv, d), torch.float16)
    v = inputs.activations((b, hkv, skv, d), torch.float16, outlier_channels=0)
    if lengths is not None:
        lengths = torch.tensor(lengths)
    got = quantize_qkv(q, k, v, block_n=16, key_lengths=lengths, permute_v=True)
    ref = quantize_qkv_reference(q, k, v, block_n=16, key_lengths=lengths, permute_v=True)
    plain = quantize_qkv(q, k, v, block_n=16, key_lengths=lengths)
    assert got.v_permuted and ref.v_permuted and not plain.v_permuted
    _assert_same_bytes(got.v_fp8, ref.v_fp8, "v_fp8 (permuted)")
    _assert_same_bytes(natural_v(got), plain.v_fp8, "v_fp8 (order undone)")
    assert not torch.equal(got.v_fp8.view(torch.uint8), plain.v_fp8.view(torch.uint8))
    assert torch.equal(got.q_int8, plain.q_int8) and torch.equal(got.k_int8, plain.k_int8)
    # the blockwise reference reads either order the same way
    assert torch.equal(quantized_attention_reference(ref, scale=0.125),
                       quantized_attention_reference(quantize_qkv_reference(
                           q, k, v, block_n=16, key_lengths=lengths), scale=0.125))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_qkv(q, k, v, block_n=8, permute_v=True)


def test_quantize_ties_correctly_rounded():
    """float16 rows whose max has a mantissa divisible by 127 put ``x * 127 / amax``
    exactly on ``n + 0.5``: the codes then depend on the last bit of ``127 / amax``.
    Kernel and reference must both use the correctly rounded quotient (a
    reciprocal-then-multiply or an approximate divide flips codes here)."""
    d = 64
    rows = []
    for m in (9, 11, 13, 15):  # amax = 127 * m * 2**e: 127 / amax is not a power of two
        for e in (-10, -7):
            amax = 127 * m * 2.0**e
            ties = [(2 * j + 1) * m * 2.0 ** (e - 1) for j in range(d - 1)]  # (2j+1)/2 steps
            rows.append([amax] + [t if t < amax else 0.0 for t in ties])
    q = torch.tensor(rows, dtype=torch.float16)[None, None]  # [1, 1, 8, 64]
    assert torch.equal(q.float(), torch.tensor(rows, dtype=torch.float32)[None, None]), "not exact in fp16"
    x = q.double()
    amax = x.abs().amax(-1, keepdim=True)
    inv = (127.0 / amax).float().double()  # the correctly rounded float32 quotient
    prod = (x * inv).float().double()  # exact in float64, then one float32 rounding
    expected = torch.where(prod >= 0, prod + 0.5, prod - 0.5).trunc().to(torch.int8)
    kv = torch.randn(1, 1, 16, d, dtype=torch.float16)
    for impl in (quantize_qkv, quantize_qkv_reference):
        got = impl(q, kv, kv, block_n=16)
        assert torch.equal(got.q_int8, expected), impl.__name__
        assert torch.equal(got.q_scale, (amax.squeeze(-1) / 127.0).float()), impl.__name__


# --------------------------------------------------------------------------- CPU: attention kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("sq,skv,d", [(37, 45, 64), (16, 16, 128), (1, 33, 64)])
def test_kernel_matches_blockwise_reference(inputs, rel_err, dtype, layout, sq, skv, d):
    b, hq, hkv = 2, 4, 2
    q = inputs.activations(_shape(layout, b, hq, sq, d), dtype)
    k = inputs.activations(_shape(layout, b, hkv, skv, d), dtype) + 1.0
    v = inputs.activations(_shape(layout, b, hkv, skv, d), dtype, outlier_channels=0)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    res, lse = sage_attention_forward(q, k, v, layout=layout, return_lse=True, out=out)
    assert res is out and not torch.isnan(out).any(), "output elements never written"
    ref_out, ref_lse = quantized_attention_reference(
        quantize_qkv_reference(q, k, v, layout=layout, block_n=16), scale=1 / math.sqrt(d),
        return_lse=True,
    )
    if layout == "bshd":
        ref_out = ref_out.transpose(1, 2)
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # float16: the output's rounding
    assert rel_err(out, ref_out) <= tol
    assert lse.dtype == torch.float32 and (lse - ref_lse).abs().max().item() <= 1e-4


def test_kernel_key_lengths_and_empty_rows(inputs, rel_err):
    b, h, sq, skv, d = 3, 2, 20, 40, 64
    q = inputs.activations((b, h, sq, d), torch.float32)
    k = inputs.activations((b, h, skv, d), torch.float32)
    v = inputs.activations((b, h, skv, d), torch.float32, outlier_channels=0)
    lengths = torch.tensor([40, 17, 0], dtype=torch.int64)
    out, lse = sage_attention_forward(q, k, v, key_lengths=lengths, return_lse=True)
    ref_out, ref_lse = quantized_attention_reference(
        quantize_qkv_reference(q, k, v, block_n=16, key_lengths=lengths), scale=1 / math.sqrt(d),
        key_lengths=lengths, return_lse=True,
    )
    assert rel_err(out, ref_out) <= 1e-5
    assert torch.equal(out[2], torch.zeros_like(out[2])), "a sample with no key outputs 0"
    assert torch.isneginf(lse[2]).all() and torch.isfinite(lse[:2]).all()
    # keys past the length are padding: not in the K mean, V scales or block scales
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 17:] = 100.0
    v2[1, :, 17:] = float("nan")
    out2 = sage_attention_forward(q, k2, v2, key_lengths=lengths)
    assert torch.equal(out2, out)


def test_other_block_shape_and_interpreter_config(inputs, rel_err):
    q, k, v = (inputs.activations((1, 2, 50, 64), torch.float32) for _ in range(3))
    cfg = SageConfig(32, 32, 4, 1)
    out = sage_attention_forward(q, k, v, config=cfg)
    ref = quantized_attention_reference(quantize_qkv_reference(q, k, v, block_n=32), scale=0.125)
    assert rel_err(out, ref) <= 1e-5


def test_score_bias_gives_the_same_scores(inputs, rel_err):
    """``score_bias``: S's int32 accumulator starts from the bits of 1.5 * 2^23, and the scores
    are read back by reinterpreting and subtracting: the same floats as the conversion, so the
    same output and LSE, bit for bit. Key lengths (the masked last block, an empty sample),
    GQA, an odd query count, outlier channels near the int8 extremes."""
    b, hq, hkv, sq, skv, d = 3, 4, 2, 37, 45, 64
    q = inputs.activations((b, hq, sq, d), torch.float32)
    k = inputs.activations((b, hkv, skv, d), torch.float32)
    v = inputs.activations((b, hkv, skv, d), torch.float32)
    lengths = torch.tensor([45, 19, 0])
    plain, plain_lse = sage_attention_forward(q, k, v, key_lengths=lengths, return_lse=True,
                                              config=SageConfig(16, 16, 4, 1))
    biased, biased_lse = sage_attention_forward(q, k, v, key_lengths=lengths, return_lse=True,
                                                config=SageConfig(16, 16, 4, 1, score_bias=True))
    assert torch.equal(biased, plain) and torch.equal(biased_lse, plain_lse)
    ref = quantized_attention_reference(quantize_qkv_reference(q, k, v, block_n=16, key_lengths=lengths),
                                        scale=1 / math.sqrt(d), key_lengths=lengths)
    assert rel_err(biased, ref) <= 1e-5
    assert "+bias" in SageConfig(64, 128, 4, 3, score_bias=True).describe()


def test_tma_descriptor_path_in_interpreter(inputs, rel_err):
    """``use_tma``: Q, K and V^T through tensor descriptors (the interpreter
    emulates them) gives the pointer path's result; int32 coordinates."""
    b, hq, hkv, sq, skv, d = 2, 4, 2, 37, 45, 64
    q = inputs.activations((b, hq, sq, d), torch.float16)
    k = inputs.activations((b, hkv, skv, d), torch.float16) + 1.0
    v = inputs.activations((b, hkv, skv, d), torch.float16, outlier_channels=0)
    lengths = torch.tensor([45, 30])
    qkv = quantize_qkv(q, k, v, block_n=16, key_lengths=lengths)
    ref, ref_lse = quantized_attention_reference(qkv, scale=0.125, key_lengths=lengths, return_lse=True)
    for cfg in (SageConfig(16, 16, 4, 1, use_tma=True), SageConfig(16, 16, 4, 1, warp_specialize=True)):
        out = torch.full_like(q, float("nan"))
        _, lse = sage_attention_quantized(qkv, out, layout="bhsd", scale=0.125, key_lengths=lengths,
                                          return_lse=True, config=cfg)
        assert rel_err(out, ref) <= 2e-3, cfg.describe()
        assert (lse - ref_lse).abs().max().item() <= 1e-4, cfg.describe()


def test_lse_includes_key_mean_and_merges_across_key_shards(rel_err):
    """The LSE is that of the scores *with* K's mean (which the smoothing takes
    out): against float32 attention's LSE it is off only by quantization error,
    and two key shards, each smoothed by its own mean, merge by their LSEs into
    the full attention (what ring attention does)."""
    gen = torch.Generator().manual_seed(11)
    q, _, _ = dit_like_qkv(gen, (1, 2, 40, 64), torch.float32)
    _, k, v = dit_like_qkv(gen, (1, 2, 96, 64), torch.float32)
    k[:, :, 48:, :8] += 4.0  # the second shard's keys have another mean
    scale = 0.125
    exact_lse = torch.logsumexp(q @ k.transpose(-1, -2) * scale, dim=-1)
    out, lse = sage_attention_forward(q, k, v, return_lse=True)
    # INT8 scores of sharp DiT-like rows: ~0.01 mean, < 0.15 worst; without the mean: units
    err = (lse - exact_lse).abs()
    assert err.mean().item() <= 0.03 and err.max().item() <= 0.15
    parts = [sage_attention_forward(q, k[:, :, sl], v[:, :, sl], return_lse=True)
             for sl in (slice(0, 48), slice(48, 96))]
    total = torch.logaddexp(parts[0][1], parts[1][1])
    merged = sum(o * torch.exp(part_lse - total)[..., None] for o, part_lse in parts)
    assert (total - exact_lse).abs().max().item() <= 0.15
    assert rel_err(merged, _exact(q, k, v)) <= 3e-2
    assert rel_err(merged, out) <= 3e-2


def test_kernel_argument_errors():
    q = torch.randn(1, 2, 16, 64)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        sage_attention_forward(torch.randn(1, 2, 16, 96), torch.randn(1, 2, 16, 96), torch.randn(1, 2, 16, 96))
    with pytest.raises(ValueError, match="dtype must be one of"):
        sage_attention_forward(q.bfloat16(), q.bfloat16(), q.bfloat16())
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        sage_attention_forward(torch.randn(1, 3, 16, 64), q, q)
    with pytest.raises(ValueError, match="scale must be positive"):
        sage_attention_forward(q, q, q, scale=-1.0)
    with pytest.raises(ValueError, match="key_lengths"):
        sage_attention_forward(q, q, q, key_lengths=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        sage_attention_forward(q.transpose(2, 3), q, q)


def test_sage_config_kernel_validation():
    with pytest.raises(ValueError, match="kernel must be one of"):
        SageConfig(64, 128, 4, 3, kernel="cutlass")
    with pytest.raises(ValueError, match="block_m=128 and block_n=128"):
        SageConfig(64, 128, 4, 3, kernel="cuda_sm90")
    assert CUDA_SM90_CONFIG.kernel == "cuda_sm90" and "cuda_sm90" in CUDA_SM90_CONFIG.describe()
    with pytest.raises(ValueError, match="cuda_quantizer applies to kernel='cuda_sm90' only"):
        SageConfig(64, 128, 4, 3, cuda_quantizer=True)
    assert "CUDA quantizer" in SageConfig(128, 128, 12, 3, kernel="cuda_sm90", cuda_quantizer=True).describe()
    for bad in (-1, 9, 2.0):
        with pytest.raises(ValueError, match="kv_splits must be an int in"):
            SageConfig(128, 128, 12, 3, kernel="cuda_sm90", kv_splits=bad)
    with pytest.raises(ValueError, match="kv_splits applies to kernel='cuda_sm90' only"):
        SageConfig(64, 128, 4, 3, kv_splits=2)
    assert "kv_splits=3" in dataclasses.replace(CUDA_SM90_CONFIG, kv_splits=3).describe()


def test_cuda_sm90_kernel_unavailable_is_a_clear_error():
    """Asking for the CUDA kernel where it cannot run names what is missing, before any work."""
    q = torch.randn(1, 2, 16, 128, dtype=torch.float16)
    reason = cuda_sm90_unsupported_reason(q.device, 128, q.dtype)
    assert reason is not None and "cuda_sm90" in reason
    with pytest.raises(RuntimeError, match="cuda_sm90"):
        sage_attention_forward(q, q, q, config=CUDA_SM90_CONFIG)


@pytest.mark.parametrize("blocks,kv_blocks,requested,expected", [
    (864, 36, 0, [864, 1]),      # Flux 1024^2: a 72-CTA tail fits one part an SM: no split
    (36, 36, 0, [0, 3]),         # one head of Flux: 3 parts of 12 key blocks, one wave
    (840, 35, 0, [792, 2]),      # SD3 1024^2: tail 48, 2 parts
    (23640, 591, 0, [23628, 8]),  # Wan 720p: tail 12, at most 8 parts
    (36, 8, 0, [0, 2]),          # short keys: parts of at least 4 key blocks
    (36, 7, 0, [36, 1]),         # too short to split at all
    (792, 36, 0, [792, 1]),      # whole waves: nothing to split
    (864, 36, 2, [792, 2]),      # forced
    (36, 36, 1, [36, 1]),        # never
])
def test_sm90_split_plan(blocks, kv_blocks, requested, expected):
    """The last-wave split's plan ([split_first, splits]) on the H200's 132 SMs."""
    from omni_kernels._extension import has_compiled_extension

    if not (has_compiled_extension() and hasattr(torch.ops.omni_kernels, "sage_attention_sm90_split_plan")):
        pytest.skip("needs omni's compiled extension with the sm90 attention")
    assert torch.ops.omni_kernels.sage_attention_sm90_split_plan(blocks, kv_blocks, 132, requested) == expected


def test_python_split_bound_is_the_kernels_cap():
    """SageConfig's kv_splits bound (MAX_KV_SPLITS, Python) is the CUDA plan's own cap
    (kSageMaxSplits, C++): a one-CTA tail with room for 132 parts gets exactly that many."""
    from omni_kernels._extension import has_compiled_extension
    from omni_kernels.attention.quantized.attention_kernel import MAX_KV_SPLITS

    if not (has_compiled_extension() and hasattr(torch.ops.omni_kernels, "sage_attention_sm90_split_plan")):
        pytest.skip("needs omni's compiled extension with the sm90 attention")
    assert torch.ops.omni_kernels.sage_attention_sm90_split_plan(133, 100000, 132, 0) == [132, MAX_KV_SPLITS]
    SageConfig(128, 128, 12, 3, kernel="cuda_sm90", kv_splits=MAX_KV_SPLITS)
    with pytest.raises(ValueError, match="kv_splits"):
        SageConfig(128, 128, 12, 3, kernel="cuda_sm90", kv_splits=MAX_KV_SPLITS + 1)


def test_cuda_quantizer_refusals_and_fake_shapes():
    """The CUDA quantizer names what it cannot take; its fake gives QuantizedQKV's shapes
    (checked under FakeTensorMode: no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from omni_kernels._extension import has_compiled_extension
    from omni_kernels.attention.quantized.quantize_cuda import (
        cuda_quantize_unsupported_reason,
        quantize_qkv_cuda,
    )

    x = torch.randn(1, 2, 16, 128, dtype=torch.float16)
    assert cuda_quantize_unsupported_reason(x, x, x) is not None
    with pytest.raises(ValueError, match="quantize_qkv_cuda"):
        quantize_qkv_cuda(x, x, x)
    if not (has_compiled_extension() and hasattr(torch.ops.omni_kernels, "sage_quantize_qkv")):
        pytest.skip("no compiled extension with sage_quantize_qkv")
    with FakeTensorMode():
        q = torch.empty(2, 300, 4, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 200, 2, 128, dtype=torch.bfloat16, device="cuda")
        outs = torch.ops.omni_kernels.sage_quantize_qkv(q, k, k, True, None, True)
        shapes = [tuple(o.shape) for o in outs]
    assert shapes == [(2, 4, 300, 128), (2, 4, 300), (2, 4, 300), (2, 2, 256, 128), (2, 2, 2),
                      (2, 2, 128), (2, 2, 128, 256), (2, 2, 2)]  # v_scale: one per key block
    assert outs[6].dtype == torch.float8_e4m3fn and outs[0].dtype == torch.int8


def test_kernel_refuses_the_other_v_order(inputs):
    """The Triton kernel reads natural-order V^T; handing it permuted V^T is an error."""
    q = inputs.activations((1, 2, 16, 64), torch.float32)
    qkv = quantize_qkv(q, q, q, block_n=16, permute_v=True)
    with pytest.raises(ValueError, match="permute_v=False"):
        sage_attention_quantized(qkv, torch.empty_like(q), layout="bhsd", scale=0.125,
                                 config=SageConfig(16, 16, 4, 1))


# --------------------------------------------------------------------------- CPU: accuracy of the math


def test_reference_accuracy_on_dit_like_inputs():
    """The quantized math against float32 attention: the issue's accuracy bar."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = dit_like_qkv(gen, (1, 2, 2048, 128), torch.float16)
    exact = _exact(q, k, v)
    out = sage_attention_reference(q, k, v)
    rel = ((out - exact).norm() / exact.norm()).item()
    cos = _row_cosine(out, exact)
    assert cos >= 0.999 and rel <= 3e-2, f"cosine {cos:.5f}, rel L2 {rel:.3e}"


def test_reference_fp8_row_sums_normalize_exactly():
    """row_sums="fp8" (the Hopper CUDA kernel's denominators: the FP8-rounded P its P V MMA
    multiplies) makes every output row a convex combination of V's rows: with every quantized
    V value equal, the output is that value to float32 rounding, while the float32 sums leave
    the FP8 rounding of P in it. On DiT-like inputs both stay within the issue's accuracy bar,
    and the two differ by P's rounding only."""
    gen = torch.Generator().manual_seed(21)
    q, k, _ = dit_like_qkv(gen, (1, 2, 300, 64), torch.float16)
    v = torch.full((1, 2, 300, 64), 0.75, dtype=torch.float16)
    lengths = torch.tensor([259])
    qkv = quantize_qkv_reference(q, k, v, block_n=32, key_lengths=lengths)
    _, _, v_deq = dequantize_qkv(qkv)
    target = v_deq[0, 0, 0, 0].item()
    assert torch.equal(v_deq[:, :, :259], torch.full_like(v_deq[:, :, :259], target))
    fp8 = quantized_attention_reference(qkv, scale=0.125, key_lengths=lengths, row_sums="fp8")
    f32 = quantized_attention_reference(qkv, scale=0.125, key_lengths=lengths)
    assert (fp8 - target).abs().max().item() <= 1e-6 * target
    assert (f32 - target).abs().max().item() > 1e-4 * target  # P's FP8 rounding shows
    q, k, v = dit_like_qkv(gen, (1, 2, 1024, 128), torch.float16)
    exact = _exact(q, k, v)
    qkv = quantize_qkv_reference(q, k, v, block_n=128)
    for row_sums in ("float32", "fp8"):
        out = quantized_attention_reference(qkv, scale=128 ** -0.5, row_sums=row_sums)
        rel = ((out - exact).norm() / exact.norm()).item()
        assert _row_cosine(out, exact) >= 0.999 and rel <= 3e-2, f"{row_sums}: rel L2 {rel:.3e}"
    with pytest.raises(ValueError, match=r"row_sums must be one of \('float32', 'fp8'\); got 'fp16'"):
        quantized_attention_reference(qkv, scale=0.125, row_sums="fp16")


def test_reference_accuracy_floor_on_zero_mean_values():
    """On i.i.d. zero-mean V, FP8's 3 mantissa bits in P and V set a floor of
    ~3.8% relative L2 (each rounding is ~2.6% RMS and does not average out
    relative to an output that is itself an average of noise); the cosine
    still passes. This pins that known limit so a regression shows."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 2048, 128, generator=gen).half() for _ in range(3))
    exact = _exact(q, k, v)
    out = sage_attention_reference(q, k, v)
    rel = ((out - exact).norm() / exact.norm()).item()
    assert _row_cosine(out, exact) >= 0.999
    assert 2e-2 <= rel <= 4.5e-2, f"rel L2 {rel:.3e}"


# --------------------------------------------------------------------------- CPU: registry


def test_backend_declaration():
    spec = get_backend("omni_sage")
    assert spec.lossy and not spec.causal and spec.key_lengths and spec.lse and spec.gqa
    assert spec.min_capability == (8, 9)
    assert set(spec.layouts) == {"bhsd", "bshd"} and tuple(spec.head_dims) == (64, 128)


def test_backend_runs_through_attention(rel_err):
    gen = torch.Generator().manual_seed(6)
    q, k, v = dit_like_qkv(gen, (1, 2, 48, 64), torch.float32)
    out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend="omni_sage",
                    layout="bshd")
    ref = sage_attention_reference(q, k, v, block_n=16)
    assert rel_err(out.transpose(1, 2), ref) <= 1e-5


def test_backend_launches_directly_in_eager_mode_and_through_the_op_otherwise(monkeypatch):
    """Eager calls with plain tensors skip the custom op's dispatch; under a dispatch mode (as
    torch.compile's tracing and fake tensors run) the call goes through the op, with the same result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import omni_kernels.attention.quantized.ops as sage_ops

    calls = []
    real = sage_ops.sage_attention_fwd

    def counting(*args, **kwargs):
        calls.append(args[3])  # the layout
        return real(*args, **kwargs)

    monkeypatch.setattr(sage_ops, "sage_attention_fwd", counting)
    gen = torch.Generator().manual_seed(7)
    q, k, v = dit_like_qkv(gen, (1, 2, 40, 64), torch.float32)
    eager = attention(q, k, v, backend="omni_sage")
    assert calls == []

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with PassThrough():
        through_op = attention(q, k, v, backend="omni_sage")
    assert calls == ["bhsd"]
    assert torch.equal(through_op, eager)


def test_backend_clear_errors():
    q = torch.randn(1, 2, 16, 64)
    name, reason = select_backend(q, q, q, backend="omni_sage", causal=True)
    assert name is None and "causal" in reason
    x = torch.randn(1, 2, 16, 80)
    name, reason = select_backend(x, x, x, backend="omni_sage")
    assert name is None and "head_dim=80" in reason
    name, reason = select_backend(q.bfloat16(), q.bfloat16(), q.bfloat16(), backend="omni_sage")
    assert name is None and "bfloat16" in reason


def test_sm90_backend_declaration_and_unavailability():
    spec = get_backend("omni_sage_sm90")
    assert spec.lossy and not spec.causal and spec.key_lengths and spec.lse and spec.gqa
    assert spec.min_capability == (9, 0) and tuple(spec.head_dims) == (128,)
    assert spec.devices == ("cuda",)
    if not torch.cuda.is_available():
        assert "torch.cuda.is_available() is False" in spec.unavailable_reason(None)
    q = torch.randn(1, 2, 16, 128, dtype=torch.float16)
    name, reason = select_backend(q, q, q, backend="omni_sage_sm90")
    assert name is None and reason


def test_auto_never_picks_lossy_unasked():
    q = torch.randn(1, 2, 16, 64)
    name, _ = select_backend(q, q, q, backend="auto", allow_lossy=False)
    assert name != "omni_sage"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to fake its capability")
def test_backend_rejects_gpu_without_fp8(monkeypatch):
    from omni_kernels.attention import spec

    monkeypatch.setattr(spec, "cuda_capability", lambda index: (8, 0))
    q = torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.float16)
    name, reason = select_backend(q, q, q, backend="omni_sage")
    assert name is None and "compute capability >= 8.9" in reason


def test_gpu_without_fp8_message(monkeypatch):
    """The kernel's own check names FP8 tensor cores (capability faked: no GPU needed)."""
    from omni_kernels.attention.quantized import attention_kernel

    class FakeCuda:
        is_cuda = True

    q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
    # the kernel module's cached lookup, faked (patching torch's query would leave a cached
    # real or fake capability behind for other tests on a GPU machine)
    monkeypatch.setattr(attention_kernel, "cuda_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    reason = attention_kernel.unsupported_reason(q, q, q, "bhsd")
    assert reason is not None and "FP8 tensor cores" in reason and "8.0" in reason


# --------------------------------------------------------------------------- GPU

GPU_SHAPES = {
    "flux-1024": (1, 24, 4608, 128),
    "wan2.1-14b-720p": (1, 40, 75600, 128),
    "hunyuanvideo-720p": (1, 24, 119040, 128),
}
CHECK_HEADS = 2
CHECK_QUERIES = 2048


def _subset_errors(out, q, k, v):
    """(row cosine, rel L2) of out's first heads / queries against float32."""
    qs = q[:, :CHECK_HEADS, :CHECK_QUERIES]
    exact = torch.cat([
        _exact(qs[:, :, i:i + 512], k[:, :CHECK_HEADS], v[:, :CHECK_HEADS])
        for i in range(0, qs.shape[2], 512)
    ], dim=2)
    o = out[:, :CHECK_HEADS, :CHECK_QUERIES].float()
    return _row_cosine(o, exact), ((o - exact).norm() / exact.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("shape_name", list(GPU_SHAPES))
def test_gpu_accuracy_at_benchmark_shapes(shape_name):
    b, h, s, d = GPU_SHAPES[shape_name]
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (compute capability >= 8.9)")
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = dit_like_qkv(gen, (b, h, s, d), torch.bfloat16, "cuda")
    out = torch.full_like(q, float("nan"))
    sage_attention_forward(q, k, v, out=out)
    assert not torch.isnan(out).any()
    cos, rel = _subset_errors(out, q, k, v)
    line = f"{shape_name}: omni_sage cosine {cos:.5f} rel L2 {rel:.3e}"
    sage = get_backend("sageattention")
    if sage.is_available(q.device) and select_backend(q, k, v, backend="sageattention")[0]:
        s_out = attention(q, k, v, backend="sageattention")
        s_cos, s_rel = _subset_errors(s_out, q, k, v)
        line += f"; sageattention cosine {s_cos:.5f} rel L2 {s_rel:.3e}"
    print(line)
    assert cos >= 0.999 and rel <= 3e-2, line


GPU_CONFIGS = [None, SageConfig(64, 128, 4, 3, use_tma=True), SageConfig(128, 128, 8, 3),
               SageConfig(128, 128, 8, 3, use_tma=True), SageConfig(64, 128, 4, 3, score_bias=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: "default" if c is None else c.describe())
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gpu_kernel_matches_blockwise_reference(layout, config):
    """The compiled attention kernel against the reference on the *same* quantized
    tensors (GPU quantizer), so only the kernel's math is compared."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (compute capability >= 8.9)")
    if config is not None and config.use_tma and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm_90")
    gen = torch.Generator(device="cuda").manual_seed(8)
    b, hq, hkv, sq, skv, d = 2, 4, 2, 1000, 3001, 128
    q, _, _ = dit_like_qkv(gen, (b, hq, sq, d), torch.float16, "cuda")
    _, k, v = dit_like_qkv(gen, (b, hkv, skv, d), torch.float16, "cuda")
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    cfg = config or default_config(d, q.device)
    lengths = torch.tensor([3001, 2000], device="cuda")
    qkv = quantize_qkv(q, k, v, layout=layout, block_n=cfg.block_n, key_lengths=lengths)
    out = torch.full_like(q, float("nan"))
    _, lse = sage_attention_quantized(qkv, out, layout=layout, scale=1 / math.sqrt(d),
                                      key_lengths=lengths, return_lse=True, config=cfg)
    ref, ref_lse = quantized_attention_reference(qkv, scale=1 / math.sqrt(d), key_lengths=lengths,
                                                 return_lse=True)
    if layout == "bshd":
        ref = ref.transpose(1, 2)
    # exp2 differs in the last bits between the GPU and torch, which moves a few
    # FP8 roundings of P by one step; the LSE sees only those last bits
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel <= 5e-3, f"rel {rel:.3e}"
    assert (lse - ref_lse).abs().max().item() <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gpu_quantize_matches_reference(layout, dtype):
    """The compiled quantizers give the reference's bytes: Q codes exactly (the
    correctly rounded 127 / amax; DiT-like float16/bfloat16 rows hit exact
    rounding ties), K codes within one step (the mean is summed in another
    order), V's FP8 bytes exactly; and the same bytes on a second run (the
    statistics are reduced in a fixed order, not by float atomics)."""
    gen = torch.Generator(device="cuda").manual_seed(10)
    q, k, v = dit_like_qkv(gen, (2, 4, 3001, 128), dtype, "cuda")
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    lengths = torch.tensor([3001, 1234], device="cuda")
    got = quantize_qkv(q, k, v, layout=layout, block_n=128, key_lengths=lengths)
    ref = quantize_qkv_reference(q, k, v, layout=layout, block_n=128, key_lengths=lengths)
    assert torch.equal(got.q_int8, ref.q_int8) and torch.equal(got.q_scale, ref.q_scale)
    for name in ("k_scale", "k_mean", "v_scale"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.q_kmean, ref.q_kmean, rtol=1e-4, atol=1e-3)  # 128-term sums
    assert (got.k_int8.int() - ref.k_int8.int()).abs().max().item() <= 1
    # exact: V's FP8 bytes are one product (the same correctly rounded 448 / amax on
    # both sides) and one round-to-nearest-even conversion (cvt.rn.satfinite.e4m3x2
    # in the kernel, c10's Float8_e4m3fn in torch); padding keys are +0 on both
    # sides (run 5's failure: the reference zeroed them by a product, giving -0.0)
    _assert_same_bytes(got.v_fp8, ref.v_fp8, "v_fp8")
    again = quantize_qkv(q, k, v, layout=layout, block_n=128, key_lengths=lengths)
    for name in ("q_int8", "q_scale", "q_kmean", "k_int8", "k_scale", "k_mean", "v_fp8", "v_scale"):
        _assert_same_bytes(getattr(again, name), getattr(got, name), f"{name} (run to run)")


@pytest.mark.gpu
def test_gpu_long_sequence_accumulation():
    """75600 keys: were FP8 partial sums carried across blocks in the MMA's short
    accumulator, the error would grow with the key count; it must not."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (compute capability >= 8.9)")
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = dit_like_qkv(gen, (1, 2, 75600, 128), torch.bfloat16, "cuda")
    out = sage_attention_forward(q, k, v)
    cos, rel = _subset_errors(out, q, k, v)
    assert cos >= 0.999 and rel <= 3e-2, f"cosine {cos:.5f}, rel L2 {rel:.3e}"


# --------------------------------------------------------------------------- GPU: the Hopper CUDA kernel


def _skip_without_cuda_sm90():
    reason = cuda_sm90_unsupported_reason(torch.device("cuda"), 128, torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gpu_cuda_sm90_matches_blockwise_reference(layout, dtype):
    """The wgmma kernel against the reference on the same quantized tensors: GQA, odd query
    count (a partial 128-row tile), key lengths (a ragged last block, an empty sample), LSE;
    outputs poisoned with NaN first."""
    _skip_without_cuda_sm90()
    gen = torch.Generator(device="cuda").manual_seed(11)
    b, hq, hkv, sq, skv, d = 3, 4, 2, 1000, 3001, 128
    q, _, _ = dit_like_qkv(gen, (b, hq, sq, d), dtype, "cuda")
    _, k, v = dit_like_qkv(gen, (b, hkv, skv, d), dtype, "cuda")
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    lengths = torch.tensor([3001, 2000, 0], device="cuda")
    qkv = quantize_qkv(q, k, v, layout=layout, block_n=128, key_lengths=lengths, permute_v=True)
    out = torch.full_like(q, float("nan"))
    # unsplit: the reference's step order (a split part rounds P under its own running max)
    _, lse = sage_attention_quantized(qkv, out, layout=layout, scale=1 / math.sqrt(d),
                                      key_lengths=lengths, return_lse=True,
                                      config=dataclasses.replace(CUDA_SM90_CONFIG, kv_splits=1))
    torch.cuda.synchronize()
    # the kernel's softmax denominators sum the FP8-rounded P (its P V MMA's ones rows)
    ref, ref_lse = quantized_attention_reference(qkv, scale=1 / math.sqrt(d), key_lengths=lengths,
                                                 return_lse=True, row_sums="fp8")
    if layout == "bshd":
        ref = ref.transpose(1, 2)
    assert not torch.isnan(out).any()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel <= 5e-3, f"rel {rel:.3e}"
    assert not out[2].float().any(), "a sample without keys gives 0"
    assert torch.isneginf(lse[2]).all()
    # The row sums come out of the FP8 MMA, whose accumulator keeps ~14 bits across its k-steps:
    # on the H200 (bf16, bhsd, this seed) the LSE was within 1.1e-3 to 1.5e-3 of the exactly
    # summed reference at worst and 1.7e-4 on average (5.8e-3 to 7.3e-3 from the float32 sums).
    lse_err = (lse[:2] - ref_lse[:2]).abs()
    assert lse_err.max().item() <= 4e-3 and lse_err.mean().item() <= 5e-4, (
        f"LSE error max {lse_err.max().item():.3e}, mean {lse_err.mean().item():.3e}")


@pytest.mark.gpu
def test_gpu_cuda_sm90_matches_triton_kernel_and_float32():
    """Flux's shape: the CUDA kernel's output against float32 attention (the issue's accuracy
    bar) and against the Triton kernel on the same inputs."""
    _skip_without_cuda_sm90()
    gen = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = dit_like_qkv(gen, (1, 24, 4608, 128), torch.bfloat16, "cuda")
    out = sage_attention_forward(q, k, v, config=CUDA_SM90_CONFIG)
    triton_out = sage_attention_forward(q, k, v)
    cos, rel = _subset_errors(out, q, k, v)
    assert cos >= 0.999 and rel <= 3e-2, f"cosine {cos:.5f}, rel L2 {rel:.3e}"
    between = ((out.float() - triton_out.float()).norm() / triton_out.float().norm()).item()
    assert between <= 1e-2, f"CUDA vs Triton rel L2 {between:.3e}"
    # the same kernel on the CUDA quantizer's tensors (K codes may differ by one step)
    cuda_quantized = sage_attention_forward(
        q, k, v, config=dataclasses.replace(CUDA_SM90_CONFIG, cuda_quantizer=True))
    between = ((cuda_quantized.float() - out.float()).norm() / out.float().norm()).item()
    assert between <= 1e-2, f"CUDA quantizer vs Triton quantizer rel L2 {between:.3e}"


@pytest.mark.gpu
def test_gpu_cuda_sm90_long_sequence_accumulation():
    """75600 keys through the CUDA kernel: the two-level accumulation keeps the error flat."""
    _skip_without_cuda_sm90()
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = dit_like_qkv(gen, (1, 2, 75600, 128), torch.bfloat16, "cuda")
    out = sage_attention_forward(q, k, v, config=CUDA_SM90_CONFIG)
    cos, rel = _subset_errors(out, q, k, v)
    assert cos >= 0.999 and rel <= 3e-2, f"cosine {cos:.5f}, rel L2 {rel:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("kv_splits", [0, 2, 3, 8])
def test_gpu_cuda_sm90_split_last_wave(kv_splits):
    """The last wave's query blocks cut into key ranges and merged in the kernel (0: the
    automatic plan, which splits this small grid; 8: more parts than a short sample has key
    blocks, so some parts are empty; a sample with no keys at all) against the unsplit kernel
    and float32. A part rounds P to FP8 under its own running max, so split and unsplit differ
    by FP8 rounding (H200: 2.4e-3 rel L2, LSE up to ~6e-3), not bit for bit."""
    _skip_without_cuda_sm90()
    gen = torch.Generator(device="cuda").manual_seed(14)
    q, k, v = dit_like_qkv(gen, (3, 2, 1000, 128), torch.bfloat16, "cuda")
    _, k, v = dit_like_qkv(gen, (3, 2, 3000, 128), torch.bfloat16, "cuda")
    lengths = torch.tensor([3000, 300, 0], device="cuda", dtype=torch.int32)
    qkv = quantize_qkv(q, k, v, block_n=128, key_lengths=lengths, permute_v=True)
    op = torch.ops.omni_kernels.sage_attention_sm90
    outs, lses = [], []
    for splits in (1, kv_splits):
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"), device="cuda")
        op(qkv.q_int8, qkv.q_scale, qkv.q_kmean, qkv.k_int8, qkv.k_scale, qkv.v_fp8, qkv.v_scale,
           lengths, qkv.seq_kv, 128 ** -0.5, out, lse, splits)
        outs.append(out)
        lses.append(lse)
    whole, split = outs
    assert not split.isnan().any() and not lses[1].isnan().any()
    assert not split[2].any() and lses[1][2].eq(float("-inf")).all(), "a sample without keys"
    between = ((split.float() - whole.float()).norm() / whole.float().norm()).item()
    assert between <= 5e-3, f"split vs whole rel L2 {between:.3e}"
    lse_gap = (lses[1][:2] - lses[0][:2]).abs().max().item()
    assert lse_gap <= 1.5e-2, f"split vs whole LSE {lse_gap:.3e}"
    # the LSE against float32's (natural log; K's mean cancels in the softmax and is added back)
    # (INT8 scores move it by up to ~6e-2 on these inputs, split or not: no worse split)
    scores = q[:2, :, :256].float() @ k[:2].float().transpose(-1, -2) * 128 ** -0.5
    key_ok = torch.arange(k.shape[2], device="cuda")[None, :] < lengths[:2, None]
    exact_lse = scores.masked_fill(~key_ok[:, None, None, :], float("-inf")).logsumexp(-1)
    err_split, err_whole = ((x[:2, :, :256] - exact_lse).abs().max().item() for x in (lses[1], lses[0]))
    assert err_split <= err_whole + 1e-2, f"split LSE vs float32 {err_split:.3e}, unsplit {err_whole:.3e}"
    for b in (0, 1):
        n = int(lengths[b])
        cos, rel = _subset_errors(split[b:b + 1], q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
        assert cos >= 0.999 and rel <= 3e-2, f"sample {b}: cosine {cos:.5f}, rel L2 {rel:.3e}"
    # the merge runs in part order whichever part finishes last: the same bits every run
    for _ in range(3):
        again = torch.full_like(q, float("nan"))
        op(qkv.q_int8, qkv.q_scale, qkv.q_kmean, qkv.k_int8, qkv.k_scale, qkv.v_fp8, qkv.v_scale,
           lengths, qkv.seq_kv, 128 ** -0.5, again, None, kv_splits)
        _assert_same_bytes(again, split, f"kv_splits={kv_splits}, run to run")
    with pytest.raises(RuntimeError, match="kv_splits must be"):
        op(qkv.q_int8, qkv.q_scale, qkv.q_kmean, qkv.k_int8, qkv.k_scale, qkv.v_fp8, qkv.v_scale,
           lengths, qkv.seq_kv, 128 ** -0.5, whole, None, 9)


# V key-block magnitudes (one scale each). "mixed": the unit changes of everyday data.
# "extreme" (bfloat16 reaches there; 3394df3's kernel gave NaN): blocks that would have
# subnormal scales or scales 1e15-1e30 below the largest, before and after a 1e3 block (sample
# 0 only); the quantizer's V floor (reference.V_AMAX_FLOOR) raises them to 2^-30.
V_BLOCK_MAGNITUDES = {
    "mixed": (1e-4, 1.0, 0.0, 1e3, 1.0, 0.0, 3.0, 1e-4, 1.0, 1e2, 1.0),
    "extreme": (1e-37, 1.0, 1e-15, 1e-30, 0.0, 1e-37, 1e3, 1e-20, 1.0, 1e2, 1.0),
}


@pytest.mark.gpu
@pytest.mark.parametrize("kv_splits", [1, 3])
@pytest.mark.parametrize("magnitudes", list(V_BLOCK_MAGNITUDES))
def test_gpu_cuda_sm90_v_block_scales_of_mixed_magnitude(magnitudes, kv_splits):
    """V key blocks of very different magnitudes (V_BLOCK_MAGNITUDES): the kernel keeps its
    accumulator in the latest block's units and rescales at each change (finite: the V floor
    bounds the change), whole and split (each part stores its output in V's own units for the
    merge), against the blockwise reference on the same quantized tensors; the Triton kernel
    too."""
    _skip_without_cuda_sm90()
    gen = torch.Generator(device="cuda").manual_seed(15)
    q, _, _ = dit_like_qkv(gen, (2, 2, 300, 128), torch.bfloat16, "cuda")
    _, k, v = dit_like_qkv(gen, (2, 2, 1300, 128), torch.bfloat16, "cuda")
    for block, magnitude in enumerate(V_BLOCK_MAGNITUDES[magnitudes]):
        v[:, :, block * 128:(block + 1) * 128] *= magnitude
    lengths = torch.tensor([1300, 700], device="cuda", dtype=torch.int32)
    qkv = quantize_qkv(q, k, v, block_n=128, key_lengths=lengths, permute_v=True)
    zero_block = V_BLOCK_MAGNITUDES[magnitudes].index(0.0)
    assert (qkv.v_scale[:, :, zero_block] == 0).all() and (qkv.v_scale[0, :, 3] > 0).all()
    if magnitudes == "extreme":  # the V floor (reference.V_AMAX_FLOOR) is what keeps o finite
        assert (qkv.v_scale[:, :, 0] == 2.0**-30).all() and (qkv.v_scale[:, :, 3] == 2.0**-30).all()
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    torch.ops.omni_kernels.sage_attention_sm90(
        qkv.q_int8, qkv.q_scale, qkv.q_kmean, qkv.k_int8, qkv.k_scale, qkv.v_fp8, qkv.v_scale,
        lengths, qkv.seq_kv, 128 ** -0.5, out, lse, kv_splits)
    torch.cuda.synchronize()
    ref, ref_lse = quantized_attention_reference(qkv, scale=128 ** -0.5, key_lengths=lengths,
                                                 return_lse=True, row_sums="fp8")
    assert not out.isnan().any()
    # split parts round P under their own running max: FP8 rounding apart, as in the split test
    tol = 5e-3 if kv_splits == 1 else 1e-2
    for b in (0, 1):  # per sample: the 1e3 block (in sample 0 only) would hide sample 1's error
        rel = ((out[b].float() - ref[b]).norm() / ref[b].norm()).item()
        assert rel <= tol, f"sample {b}, kv_splits={kv_splits}: rel {rel:.3e}"
    assert (lse - ref_lse).abs().max().item() <= 1.5e-2
    if kv_splits == 1:  # the Triton kernel (V's scale applied per block) on the same data
        qkv = quantize_qkv(q, k, v, block_n=128, key_lengths=lengths)
        triton_out = torch.full_like(q, float("nan"))
        sage_attention_quantized(qkv, triton_out, layout="bhsd", scale=128 ** -0.5,
                                 key_lengths=lengths)
        ref = quantized_attention_reference(qkv, scale=128 ** -0.5, key_lengths=lengths)
        for b in (0, 1):
            rel = ((triton_out[b].float() - ref[b]).norm() / ref[b].norm()).item()
            assert rel <= 5e-3, f"Triton kernel, sample {b}: rel {rel:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["triton", "cuda_sm90", "cuda_sm90-split-lengths"])
def test_gpu_programmatic_launch_gives_the_same_bytes(case, monkeypatch):
    """The chain K mean -> codes -> attention launched as programmatic dependents (PDL, Hopper)
    against plain launches: the same bytes, eager and replayed in a CUDA graph. The calls
    alternate between two inputs, so a kernel that read before its wait would find the other
    input's codes (the caching allocator hands the freed buffers of one call to the next)."""
    from omni_kernels import _launch

    implementation = case.split("-")[0]
    if implementation == "cuda_sm90":
        _skip_without_cuda_sm90()
    elif torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (compute capability >= 8.9)")
    if not _launch.programmatic_launch_enabled(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0, Triton's "
                    "grid dependency control and OMNI_PDL != 0")
    gen = torch.Generator(device="cuda").manual_seed(21)
    # one head of 1000 keys: few CTAs, so a split plan splits every query block
    shape = (2, 3, 1000, 128) if case.endswith("lengths") else (1, 24, 1536, 128)
    inputs = [dit_like_qkv(gen, shape, torch.bfloat16, "cuda") for _ in range(2)]
    lengths = (torch.tensor([1000, 333], device="cuda", dtype=torch.int32)
               if case.endswith("lengths") else None)
    config = CUDA_SM90_CONFIG if implementation == "cuda_sm90" else None
    if case.endswith("split-lengths"):
        config = dataclasses.replace(CUDA_SM90_CONFIG, kv_splits=3)

    def run(i, out=None, lse=None):
        q, k, v = inputs[i]
        got = sage_attention_forward(q, k, v, key_lengths=lengths, return_lse=True,
                                     out=out, config=config)
        if lse is not None:
            lse.copy_(got[1])
        return got

    monkeypatch.setattr(_launch, "_PDL_ALLOWED", False)
    plain = [tuple(t.clone() for t in run(i)) for i in (0, 1)]
    monkeypatch.setattr(_launch, "_PDL_ALLOWED", True)
    for round_ in range(3):
        for i in (0, 1):
            out = torch.full_like(inputs[i][0], float("nan"))
            got_out, got_lse = run(i, out=out)
            _assert_same_bytes(got_out, plain[i][0], f"{case} PDL input {i} round {round_}: out")
            _assert_same_bytes(got_lse, plain[i][1], f"{case} PDL input {i} round {round_}: lse")
    # captured with PDL edges, replayed twice over the two inputs
    static_in = [t.clone() for t in inputs[0]]
    static_out = torch.empty_like(static_in[0])
    static_lse = torch.empty(static_in[0].shape[:3], device="cuda")
    saved = inputs[0]
    inputs[0] = static_in
    run(0, out=static_out, lse=static_lse)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(0, out=static_out, lse=static_lse)
    for i in (1, 0):
        for dst, src in zip(static_in, saved if i == 0 else inputs[1]):
            dst.copy_(src)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_same_bytes(static_out, plain[i][0], f"{case} CUDA graph input {i}: out")
        _assert_same_bytes(static_lse, plain[i][1], f"{case} CUDA graph input {i}: lse")


@pytest.mark.gpu
def test_gpu_cuda_sm90_op_argument_errors():
    """The C++ op's own checks: natural-order shapes it cannot take raise naming the argument."""
    _skip_without_cuda_sm90()
    gen = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = dit_like_qkv(gen, (1, 2, 200, 128), torch.bfloat16, "cuda")
    qkv = quantize_qkv(q, k, v, block_n=128, permute_v=True)
    out = torch.empty_like(q)
    op = torch.ops.omni_kernels.sage_attention_sm90
    args = [qkv.q_int8, qkv.q_scale, qkv.q_kmean, qkv.k_int8, qkv.k_scale, qkv.v_fp8, qkv.v_scale,
            None, qkv.seq_kv, 0.0883883, out, None]
    bad_v = list(args)
    bad_v[5] = qkv.v_fp8.transpose(-1, -2).contiguous()
    with pytest.raises(RuntimeError, match="v_fp8 dimension 2 must be 128"):
        op(*bad_v)
    bad_len = list(args)
    bad_len[8] = 100
    with pytest.raises(RuntimeError, match="seq_kv must be in"):
        op(*bad_len)
    bad_out = list(args)
    bad_out[10] = out.float()
    with pytest.raises(RuntimeError, match="out must be bfloat16 or float16"):
        op(*bad_out)
    bad_scale = list(args)
    bad_scale[9] = 0.0
    with pytest.raises(RuntimeError, match="scale must be positive and finite"):
        op(*bad_scale)


@pytest.mark.gpu
def test_gpu_sm90_backend_through_attention():
    """The registry backend: bshd, GQA, key lengths and the LSE against float32 attention."""
    _skip_without_cuda_sm90()
    gen = torch.Generator(device="cuda").manual_seed(14)
    q, _, _ = dit_like_qkv(gen, (2, 8, 777, 128), torch.bfloat16, "cuda")
    _, k, v = dit_like_qkv(gen, (2, 2, 1500, 128), torch.bfloat16, "cuda")
    lengths = torch.tensor([1500, 641], device="cuda", dtype=torch.int32)
    out, lse = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                         backend="omni_sage_sm90", layout="bshd", key_lengths=lengths,
                         return_lse=True)
    out = out.transpose(1, 2).float()
    for b, n in enumerate(lengths.tolist()):
        exact = _exact(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
        rel = ((out[b:b + 1] - exact).norm() / exact.norm()).item()
        assert rel <= 3e-2 and _row_cosine(out[b:b + 1], exact) >= 0.999, f"sample {b}: rel {rel:.3e}"
        scores = q[b].float() @ k[b, :, :n].float().repeat_interleave(4, 0).transpose(-1, -2)
        exact_lse = torch.logsumexp(scores / math.sqrt(128), dim=-1)
        assert (lse[b] - exact_lse).abs().max().item() <= 0.15


@pytest.mark.gpu
@pytest.mark.parametrize("permute_v", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gpu_cuda_quantizer_matches_reference(layout, dtype, permute_v):
    """The CUDA quantizer gives the reference's bytes (Q codes and V's FP8 exactly, K codes
    within one step: the mean is summed in another order), the Triton quantizer's Q/V bytes,
    and the same bytes on a second run. GQA, an odd key count, key lengths with an empty
    sample, tiny Q rows and a tiny V block."""
    from omni_kernels.attention.quantized.quantize_cuda import (
        cuda_quantize_unsupported_reason,
        quantize_qkv_cuda,
    )

    gen = torch.Generator(device="cuda").manual_seed(15)
    q, _, _ = dit_like_qkv(gen, (3, 4, 1001, 128), dtype, "cuda")
    _, k, v = dit_like_qkv(gen, (3, 2, 3001, 128), dtype, "cuda")
    # groups below 2^-100 (top / amax would overflow float32; bfloat16 holds them, float16
    # flushes them to zero groups): Q rows and a V key block
    q[:, :, 5:9] *= 1e-38
    v[:, :, 128:256] *= 1e-38
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    reason = cuda_quantize_unsupported_reason(q, k, v)
    if reason is not None:
        pytest.skip(reason)
    lengths = torch.tensor([3001, 1234, 0], device="cuda")
    got = quantize_qkv_cuda(q, k, v, layout=layout, key_lengths=lengths, permute_v=permute_v)
    ref = quantize_qkv_reference(q, k, v, layout=layout, block_n=128, key_lengths=lengths,
                                 permute_v=permute_v)
    tri = quantize_qkv(q, k, v, layout=layout, block_n=128, key_lengths=lengths, permute_v=permute_v)
    assert got.v_permuted == permute_v
    assert torch.equal(got.q_int8, ref.q_int8) and torch.equal(got.q_scale, ref.q_scale)
    for name in ("k_scale", "k_mean", "v_scale"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.q_kmean, ref.q_kmean, rtol=1e-4, atol=1e-3)
    assert (got.k_int8.int() - ref.k_int8.int()).abs().max().item() <= 1
    _assert_same_bytes(got.v_fp8, ref.v_fp8, "v_fp8")
    _assert_same_bytes(got.v_fp8, tri.v_fp8, "v_fp8 (vs Triton)")
    assert torch.equal(got.q_int8, tri.q_int8)
    again = quantize_qkv_cuda(q, k, v, layout=layout, key_lengths=lengths, permute_v=permute_v)
    for name in ("q_int8", "q_scale", "q_kmean", "k_int8", "k_scale", "k_mean", "v_fp8", "v_scale"):
        _assert_same_bytes(getattr(again, name), getattr(got, name), f"{name} (run to run)")


def _sm90_on(qkv, scale, lengths=None):
    out = torch.full((*qkv.q_int8.shape[:3], 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    sage_attention_quantized(qkv, out, layout="bhsd", scale=scale, key_lengths=lengths,
                             config=CUDA_SM90_CONFIG)
    torch.cuda.synchronize()
    return out.float()


@pytest.mark.gpu
def test_gpu_cuda_sm90_uniform_attention_isolates_pv():
    """q = 0: every score is 0, P is 448 for every key, and out is the mean of the quantized V
    over the valid keys. This checks the P V product, V^T's TMA tile and its key permutation
    apart from Q K^T (a failure here and not in the QK test below points at the PV side)."""
    _skip_without_cuda_sm90()
    gen = torch.Generator(device="cuda").manual_seed(16)
    _, k, v = dit_like_qkv(gen, (1, 2, 300, 128), torch.bfloat16, "cuda")
    q = torch.zeros(1, 2, 130, 128, device="cuda", dtype=torch.bfloat16)
    qkv = quantize_qkv(q, k, v, block_n=128, permute_v=True)
    out = _sm90_on(qkv, 0.0883883)
    _, _, v_deq = dequantize_qkv(qkv)
    expected = v_deq.mean(dim=2, keepdim=True).expand_as(out)
    rel = ((out - expected).norm() / expected.norm()).item()
    assert rel <= 1e-2, f"rel {rel:.3e}: the PV side (V^T tile, key permutation, A fragments)"


@pytest.mark.gpu
def test_gpu_cuda_sm90_identity_values_isolate_qk():
    """128 keys and V = 16 x identity: out[i, j] = 16 * softmax(S)[i, j], so the output *is*
    the attention matrix, row by row, against the reference's probabilities. Checks Q K^T (the
    K tile, the s8 wgmma, the per-row and per-block scales) and the softmax."""
    _skip_without_cuda_sm90()
    gen = torch.Generator(device="cuda").manual_seed(17)
    q, k, _ = dit_like_qkv(gen, (1, 1, 128, 128), torch.bfloat16, "cuda")
    v = (16 * torch.eye(128, device="cuda", dtype=torch.bfloat16))[None, None]
    qkv = quantize_qkv(q, k, v, block_n=128, permute_v=True)
    out = _sm90_on(qkv, 0.0883883)
    ref = quantized_attention_reference(qkv, scale=0.0883883, row_sums="fp8")
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel <= 1e-2, f"rel {rel:.3e}: the QK side (K tile, s8 wgmma, scales, softmax)"
    assert torch.allclose(out.sum(-1), torch.full_like(out.sum(-1), 16.0), rtol=5e-2)
