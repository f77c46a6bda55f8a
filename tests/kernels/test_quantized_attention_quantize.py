"""Tests of omni_sage's Q/K/V quantization (:func:`quantize_qkv`) against
:func:`quantize_qkv_reference`.

CPU part (CI, Triton's interpreter): exact expected scales and codes on hand-made inputs
(K's strided mean, V blocks of mixed magnitude, tiny groups, V's floor, rounding ties), and
the same bytes on random float16/float32 inputs in both layouts with a ragged last key block;
V's key permutation; the CUDA quantizer's refusals and fake shapes.

GPU part (``-m gpu``): the compiled Triton and CUDA quantizers give the reference's bytes.
"""

from __future__ import annotations

import math

import pytest
import torch

from omni_kernels.attention.quantized.attention_kernel import SageConfig, sage_attention_forward
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
    v_key_permutation,
)

from quantized_attention_cases import _assert_same_bytes, _shape


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


# --------------------------------------------------------------------------- GPU


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
