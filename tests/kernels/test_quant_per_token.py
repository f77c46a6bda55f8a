"""Tests of per-token activation quantization (:func:`omni_kernels.quant.quantize_per_token`)
against the reference.

CPU part (CI): exact scales and values on hand-made rows; the Triton kernel under Triton's
interpreter (INT8 from float32/float16: the interpreter has no FP8 or bfloat16) against the
reference, with and without the fused norm/adaLN; the chunked path for long rows; fused vs
unfused; round trips. FP8 is checked through the torch reference on CPU (torch casts to
``float8_e4m3fn`` on CPU).

GPU part (``-m gpu``): the CUDA and Triton kernels at Flux/Wan widths in bfloat16/float16, FP8
and INT8, against the reference. Kernel outputs are allocated by the ops themselves; the
caching allocator is first filled with 0xFF bytes (NaN as float8/float32), so an element the
kernel fails to write shows up.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omni_kernels._triton import triton_interpreter_enabled
from omni_kernels.quant import (
    FP8_DTYPE,
    FP8_MAX,
    INT8_MAX,
    MIN_ABSMAX,
    dequantize,
    quantize_per_token,
    quantize_per_token_reference,
)

from quant_per_token_cases import (
    _assert_same_quantization,
    _poison_cuda_allocator,
    _require_cuda_extension,
    _require_fp8,
    needs_interpreter_or_gpu,
)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter_or_gpu)])
def test_int8_hand_made_row(backend):
    """[1, -4, 2] -> scale 4/127, values round(31.75), -127, round(63.5) = [32, -127, 64]."""
    x = torch.tensor([[1.0, -4.0, 2.0]])
    q, scale = quantize_per_token(x, "int8", backend=backend)
    assert q.dtype == torch.int8 and scale.shape == (1, 1)
    assert scale.item() == (torch.tensor(4.0) / 127.0).item()
    assert q.tolist() == [[32, -127, 64]]


def test_fp8_hand_made_row():
    """[1, -4, 2] -> scale 4/448; 1 * 112 = 112, -448, 224: all exact e4m3 values."""
    x = torch.tensor([[1.0, -4.0, 2.0]])
    q, scale = quantize_per_token(x, "fp8", backend="torch")
    assert q.dtype == FP8_DTYPE
    assert scale.item() == (torch.tensor(4.0) / 448.0).item()
    assert q.float().tolist() == [[112.0, -448.0, 224.0]]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter_or_gpu)])
def test_int8_rounds_half_to_even_and_clamps(backend):
    """absmax 127 makes the scale 1, so the row's halves show the rounding rule."""
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.49, -126.5]])
    q, scale = quantize_per_token(x, "int8", backend=backend)
    assert scale.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, 3, -126]]
    # clamp=2: the row's absmax becomes 2, the scale 2/127, everything beyond saturates.
    q, scale = quantize_per_token(torch.tensor([[1.0, -4.0, 2.0]]), "int8", clamp=2.0, backend=backend)
    assert scale.item() == (torch.tensor(2.0) / 127.0).item()
    assert q.tolist() == [[64, -127, 127]]  # 63.5 rounds to even: 64


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter_or_gpu)])
def test_zero_row_is_guarded(backend):
    """An all-zero row gives q = 0 and a tiny positive scale (no 0/0), the other rows their own."""
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.5, -1.0, 0.25, 0.0]])
    q, scale = quantize_per_token(x, "int8", backend=backend)
    assert q[0].tolist() == [0, 0, 0, 0]
    assert scale[0].item() == pytest.approx(MIN_ABSMAX / INT8_MAX, rel=1e-6)
    assert scale[1].item() == (torch.tensor(1.0) / 127.0).item()
    assert torch.equal(dequantize(q, scale)[0], torch.zeros(4))
    q8, s8 = quantize_per_token(x, "fp8", backend="torch")
    assert torch.equal(q8[0].float(), torch.zeros(4)) and s8[0].item() > 0


def test_fp8_saturates_and_rounds_to_nearest_even():
    """Values are clamped to +-448 before the cast; in between, round to nearest even."""
    # amax 448 -> scale 1. 17 and 19 are ties between e4m3 neighbours (16, 18, 20): to even.
    # The smallest subnormal is 2**-9: 0.001 rounds up to it, 0.0009 (< 2**-10) down to 0.
    x = torch.tensor([[448.0, 17.0, 19.0, -240.0, 0.001, 0.0009]])
    q, scale = quantize_per_token(x, "fp8", backend="torch")
    assert scale.item() == 1.0
    assert q.float().tolist() == [[448.0, 16.0, 20.0, -240.0, 2.0**-9, 0.0]]


# (rows shape, K): K not a power of two, not a multiple of 8, leading dims folded into rows.
SHAPES = [
    pytest.param((1,), 8, id="M1-K8"),
    pytest.param((7,), 40, id="M7-K40"),
    pytest.param((2, 3), 72, id="B2-S3-K72"),
    pytest.param((5,), 131, id="M5-K131"),
]


@needs_interpreter_or_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("lead,k", SHAPES)
def test_triton_plain_matches_reference_exactly(inputs, lead, k, dtype):
    """Without a norm the kernel's float32 arithmetic is the reference's: bit-identical."""
    x = inputs.activations((*lead, k), dtype)
    q, scale = quantize_per_token(x, "int8", backend="triton")
    assert q.shape == x.shape and scale.shape == (*lead, 1)
    q_ref, scale_ref = quantize_per_token_reference(x.reshape(-1, k), torch.int8)
    _assert_same_quantization(q.reshape(-1, k), scale.reshape(-1, 1), q_ref, scale_ref)


def _fusion_arguments(inputs, variant, rows, k, groups, dtype):
    if variant == "rms":
        return dict(norm="rms", norm_weight=inputs.weight(k, dtype), eps=1e-6)
    if variant == "layer":
        return dict(norm="layer", eps=1e-6)
    if variant == "layer_affine":
        return dict(norm="layer", norm_weight=inputs.weight(k, torch.float32),
                    norm_bias=0.1 * inputs.activations((k,), dtype, outlier_channels=0), eps=1e-5)
    if variant == "adaln":
        return dict(
            norm="layer", eps=1e-6,
            mod_scale=0.5 * inputs.activations((groups, k), dtype, outlier_channels=0),
            mod_shift=inputs.activations((groups, k), torch.float32, outlier_channels=0),
        )
    if variant == "modulate_only":
        return dict(mod_scale=0.5 * inputs.activations((groups, 1, k), dtype, outlier_channels=0))
    if variant == "adaln_clamp":
        return dict(norm="layer", eps=1e-6, clamp=2.0,
                    mod_shift=inputs.activations((groups, k), dtype, outlier_channels=0))
    raise ValueError(variant)


FUSIONS = ["rms", "layer", "layer_affine", "adaln", "modulate_only", "adaln_clamp"]


@needs_interpreter_or_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("variant", FUSIONS)
def test_triton_fused_matches_reference(inputs, variant, dtype):
    """Fused norm/adaLN + quantization; the sums run in another order than the reference's,
    so a value next to a rounding boundary may land one step away."""
    rows, k, groups = 6, 200, 2
    x = inputs.activations((rows, k), dtype)
    options = _fusion_arguments(inputs, variant, rows, k, groups, dtype)
    q, scale = quantize_per_token(x, "int8", backend="triton", **options)
    reference_options = dict(options)
    for name in ("mod_scale", "mod_shift"):
        if reference_options.get(name) is not None:
            reference_options[name] = reference_options[name].reshape(-1, k)
    q_ref, scale_ref = quantize_per_token_reference(x, torch.int8, **reference_options)
    _assert_same_quantization(q, scale, q_ref, scale_ref, max_code_diff=1, max_diff_fraction=0.01,
                              scale_rtol=1e-5)


@needs_interpreter_or_gpu
@pytest.mark.parametrize("variant", [None, "layer", "adaln"])
def test_triton_chunked_long_rows(inputs, variant):
    """Rows longer than the register tile take the multi-pass path (forced with a small tile)."""
    from omni_kernels.quant.dispatch import _NORM_CODES
    from omni_kernels.quant.triton_kernel import launch_quantize_per_token_triton

    rows, k, groups = 4, 100, 2
    x = inputs.activations((rows, k), torch.float32)
    options = _fusion_arguments(inputs, variant, rows, k, groups, torch.float32) if variant else {}
    q, scale = launch_quantize_per_token_triton(
        x, options.get("norm_weight"), options.get("norm_bias"), options.get("mod_scale"),
        options.get("mod_shift"), _NORM_CODES[options.get("norm")], options.get("eps", 1e-6), 0.0,
        torch.int8, max_tile=16,
    )
    q_ref, scale_ref = quantize_per_token_reference(x, torch.int8, **options)
    _assert_same_quantization(q, scale, q_ref, scale_ref, max_code_diff=1, max_diff_fraction=0.02,
                              scale_rtol=1e-5)


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_fused_equals_unfused(inputs, qdtype):
    """adaLN fused into the quantization = diffusers' LayerNorm + modulation, then quantization.

    Computed in float64 on both sides where the unfused one allows, the two differ
    by the float32 arithmetic only: at most one quantization step, rarely.
    """
    batch, seq, k = 2, 5, 64
    x = inputs.activations((batch, seq, k), torch.float32)
    shift = inputs.activations((batch, k), torch.float32, outlier_channels=0)
    scale_mod = 0.3 * inputs.activations((batch, k), torch.float32, outlier_channels=0)
    unfused = F.layer_norm(x, (k,), eps=1e-6) * (1 + scale_mod[:, None]) + shift[:, None]
    q_u, s_u = quantize_per_token(unfused, qdtype, backend="torch")
    backend = "triton" if qdtype == "int8" and triton_interpreter_enabled() else "torch"
    q_f, s_f = quantize_per_token(x, qdtype, norm="layer", eps=1e-6, mod_scale=scale_mod,
                                  mod_shift=shift, backend=backend)
    _assert_same_quantization(q_f.reshape(-1, k), s_f.reshape(-1, 1), q_u.reshape(-1, k),
                              s_u.reshape(-1, 1), max_code_diff=1, max_diff_fraction=0.02,
                              scale_rtol=1e-5)


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_round_trip_error_bound(inputs, qdtype):
    """dequantize(quantize(x)) is within half a step: scale/2 for INT8, 2**-4 relative for FP8
    (3 mantissa bits; subnormals near zero get the absolute step of the smallest binade)."""
    x = inputs.activations((9, 96), torch.float32)
    q, scale = quantize_per_token(x, qdtype, backend="torch")
    err = (dequantize(q, scale) - x).abs()
    if qdtype == "int8":
        assert (err <= scale / 2 * (1 + 1e-6)).all()
    else:
        bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
        assert (err <= bound * (1 + 1e-6)).all()
        assert (dequantize(q, scale).abs().amax(-1, keepdim=True) == x.abs().amax(-1, keepdim=True)).all()


@pytest.mark.parametrize("qdtype", [torch.int8, FP8_DTYPE], ids=["int8", "fp8"])
def test_reference_scale_formula(inputs, qdtype):
    """scale = max|row| / QMAX per row, float32; the largest element maps to +-QMAX."""
    x = inputs.activations((4, 33), torch.float32)
    q, scale = quantize_per_token_reference(x, qdtype)
    qmax = FP8_MAX if qdtype == FP8_DTYPE else INT8_MAX
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / qmax)
    assert (q.float().abs().amax(-1) == qmax).all()


# ============================================================================ GPU


# (rows, K, description): Flux 1024^2 (4096 image + 512 text tokens) at its linear inputs
# (3072 hidden, 12288 MLP, 15360 single-block proj_out); Wan2.1-14B 720p (75600 tokens, 5120);
# odd row counts and the CUDA kernel's widest row.
GPU_SHAPES = [
    pytest.param(4608, 3072, id="flux-hidden"),
    pytest.param(4608, 12288, id="flux-mlp"),
    pytest.param(4608, 15360, id="flux-single-proj-out"),
    pytest.param(75600, 5120, id="wan14b-hidden"),
    pytest.param(333, 13824, id="wan14b-ffn-M333"),
    pytest.param(17, 32768, id="cuda-max-row"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("rows,k", GPU_SHAPES)
def test_gpu_plain_matches_reference(inputs, rows, k, backend, dtype, qdtype):
    """No norm: the scale and every value are the reference's, bit for bit."""
    if backend == "cuda":
        _require_cuda_extension()
    _require_fp8(qdtype)
    x = inputs.activations((rows, k), dtype, "cuda")
    _poison_cuda_allocator(2 * x.numel())
    q, scale = quantize_per_token(x, qdtype, backend=backend)
    torch.cuda.synchronize()
    q_ref, scale_ref = quantize_per_token_reference(x, q.dtype)
    if backend == "triton" and qdtype == "fp8":
        # Should Triton's float32 -> e4m3 conversion go through float16 (rounding twice), a
        # value next to a tie could land one step away; everything else is bit-exact.
        _assert_same_quantization(q, scale, q_ref, scale_ref, max_code_diff=1, max_diff_fraction=1e-3)
    else:
        _assert_same_quantization(q, scale, q_ref, scale_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", ["fp8", "int8"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("variant", FUSIONS)
@pytest.mark.parametrize("rows,k", [GPU_SHAPES[0], GPU_SHAPES[1], GPU_SHAPES[4]])
def test_gpu_fused_matches_reference(inputs, rows, k, variant, backend, qdtype):
    """Fused norm/adaLN in bfloat16 (one modulation row for all tokens): within one step, rarely."""
    if backend == "cuda":
        _require_cuda_extension()
    _require_fp8(qdtype)
    dtype = torch.bfloat16
    x = inputs.activations((rows, k), dtype, "cuda")
    options = {}
    for name, value in _fusion_arguments(inputs, variant, rows, k, 1, dtype).items():
        options[name] = value.to("cuda") if isinstance(value, torch.Tensor) else value
    _poison_cuda_allocator(2 * x.numel())
    q, scale = quantize_per_token(x, qdtype, backend=backend, **options)
    torch.cuda.synchronize()
    reference_options = {n: (v.reshape(-1, k) if n.startswith("mod_") else v) for n, v in options.items()}
    q_ref, scale_ref = quantize_per_token_reference(x, q.dtype, **reference_options)
    _assert_same_quantization(q, scale, q_ref, scale_ref, max_code_diff=1, max_diff_fraction=0.01,
                              scale_rtol=1e-5)


@pytest.mark.gpu
def test_gpu_cuda_and_triton_agree_and_zero_rows(inputs):
    """Zero rows and a row of one huge outlier on the GPU kernels; both backends agree."""
    _require_cuda_extension()
    x = inputs.activations((129, 3072), torch.bfloat16, "cuda")
    x[3] = 0
    x[5, 17] = 3.0e4
    for qdtype in ("int8",) + (("fp8",) if torch.cuda.get_device_capability() >= (8, 9) else ()):
        q_c, s_c = quantize_per_token(x, qdtype, backend="cuda")
        q_t, s_t = quantize_per_token(x, qdtype, backend="triton")
        assert torch.equal(s_c, s_t)
        assert torch.equal(q_c.view(torch.uint8), q_t.view(torch.uint8))
        assert (q_c[3].float() == 0).all() and s_c[3].item() > 0
