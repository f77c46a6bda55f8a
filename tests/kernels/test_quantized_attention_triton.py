"""Tests of omni_sage's Triton attention kernel (INT8 Q K^T, FP8 P V) against the blockwise
reference (:func:`quantized_attention_reference`, the kernel's exact math).

CPU part (CI, Triton's interpreter): both layouts, GQA, key lengths (an empty sample too),
other block shapes, the score bias, tensor descriptors, the log-sum-exp and its merge across
key shards, argument errors. The interpreter runs the real ``int8 x int8 -> int32`` and
``float8 x float8`` dots; only its float32 -> float8 rounding is replaced (it does not carry
into the exponent, see :mod:`...quantized.quantize`).

GPU part (``-m gpu``): the compiled kernel at the benchmark shapes against float32 (cosine per
row, relative L2) beside sageattention's figures on the same inputs, against the reference on
the same quantized tensors, and over a long key sequence.
"""

from __future__ import annotations

import math

import pytest
import torch

from omni_kernels.attention import attention, get_backend, select_backend
from omni_kernels.attention.quantized.attention_kernel import (
    SageConfig,
    default_config,
    sage_attention_forward,
    sage_attention_quantized,
)
from omni_kernels.attention.quantized.quantize import quantize_qkv
from omni_kernels.attention.quantized.reference import (
    dit_like_qkv,
    quantize_qkv_reference,
    quantized_attention_reference,
)

from quantized_attention_cases import _exact, _shape, _subset_errors


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


def test_kernel_refuses_the_other_v_order(inputs):
    """The Triton kernel reads natural-order V^T; handing it permuted V^T is an error."""
    q = inputs.activations((1, 2, 16, 64), torch.float32)
    qkv = quantize_qkv(q, q, q, block_n=16, permute_v=True)
    with pytest.raises(ValueError, match="permute_v=False"):
        sage_attention_quantized(qkv, torch.empty_like(q), layout="bhsd", scale=0.125,
                                 config=SageConfig(16, 16, 4, 1))


# --------------------------------------------------------------------------- GPU


GPU_SHAPES = {
    "flux-1024": (1, 24, 4608, 128),
    "wan2.1-14b-720p": (1, 40, 75600, 128),
    "hunyuanvideo-720p": (1, 24, 119040, 128),
}


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
