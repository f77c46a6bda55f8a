"""Tests of per-token activation quantization (:func:`omni_kernels.quant.quantize_per_token`).

CPU part (CI): exact scales and values on hand-made rows; the Triton kernel
under Triton's interpreter (INT8 from float32/float16: the interpreter has no
FP8 or bfloat16) against the reference, with and without the fused
norm/adaLN; the chunked path for long rows; fused vs unfused; round trips;
argument checks; ``torch.library.opcheck``; ``torch.compile``. FP8 is checked
through the torch reference on CPU (torch casts to ``float8_e4m3fn`` on CPU).

GPU part (``-m gpu``): the CUDA and Triton kernels at Flux/Wan widths in
bfloat16/float16, FP8 and INT8, against the reference.

Kernel outputs are allocated by the ops themselves; on the GPU the caching
allocator is first filled with 0xFF bytes (NaN as float8/float32), so an
element the kernel fails to write shows up.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from omni_kernels import has_compiled_extension
from omni_kernels._triton import triton_interpreter_enabled
from omni_kernels.quant import (
    FP8_DTYPE,
    FP8_MAX,
    INT8_MAX,
    MIN_ABSMAX,
    dequantize,
    quantize_per_token,
    quantize_per_token_reference,
    supported_backends,
)

needs_interpreter_or_gpu = pytest.mark.skipif(
    not (triton_interpreter_enabled() or torch.cuda.is_available()),
    reason="the Triton kernel needs a GPU or TRITON_INTERPRET=1",
)

# ----------------------------------------------------------------------------- helpers


def _assert_same_quantization(q, scale, q_ref, scale_ref, *, max_code_diff=0, max_diff_fraction=0.0,
                              scale_rtol=0.0):
    """``scale`` within ``scale_rtol`` of the reference; ``q`` equal, or (for fused norms,
    whose float32 sums run in another order) off by at most ``max_code_diff`` quantization
    steps in at most ``max_diff_fraction`` of the elements."""
    assert q.shape == q_ref.shape and q.dtype == q_ref.dtype
    assert scale.shape == scale_ref.shape and scale.dtype == torch.float32
    assert torch.isfinite(scale).all() and (scale > 0).all()
    rel = ((scale.double() - scale_ref.double()).abs() / scale_ref.double()).max().item()
    assert rel <= scale_rtol, f"scale relative difference {rel:.3e} > {scale_rtol:.1e}"
    if q.dtype == FP8_DTYPE:
        assert not torch.isnan(q.float()).any(), "NaN in the FP8 output (unwritten or overflow)"
        # Distance in e4m3 steps: the spacing at |b| is 2**(floor(log2|b|) - 3), at least 2**-9.
        a, b = q.double(), q_ref.double()
        # frexp, not floor(log2): CUDA's log2 of an exact power of two can land just below it.
        exponent = torch.frexp(b.abs().clamp_min(2.0**-6)).exponent.double() - 1
        codes = (a - b).abs() / torch.pow(2.0, exponent - 3)
    else:
        codes = (q.int() - q_ref.int()).abs().double()
    worst = codes.max().item()
    if worst > max_code_diff + 1e-9:
        at = int(codes.argmax().item())
        row = at // q.shape[-1]
        raise AssertionError(
            f"quantized values differ by up to {worst} steps: at flat index {at} (row {row}) "
            f"{q.reshape(-1)[at].item()} vs reference {q_ref.reshape(-1)[at].item()}, row scale "
            f"{scale.reshape(-1)[row].item():.9e} vs {scale_ref.reshape(-1)[row].item():.9e}; "
            f"{int((codes > max_code_diff + 1e-9).sum().item())} such values"
        )
    fraction = (codes > 0).double().mean().item()
    assert fraction <= max_diff_fraction, f"{fraction:.2e} of the values differ (allowed {max_diff_fraction:.1e})"


def _poison_cuda_allocator(nbytes: int) -> None:
    """Fill freed blocks of the caching allocator with 0xFF so unwritten outputs are NaN/-1."""
    block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    block.fill_(0xFF)
    del block


# ============================================================================ CPU: exact values


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


# ============================================================================ CPU: Triton vs reference

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


# ============================================================================ CPU: argument checks


def _valid():
    return dict(x=torch.randn(2, 3, 16), dtype="int8")


BAD_ARGUMENTS = [
    ("dtype", dict(dtype="int4"), r"dtype must be 'fp8' .* or 'int8'"),
    ("x_int", dict(x=torch.ones(2, 16, dtype=torch.int32)), r"x must be float16, bfloat16 or float32"),
    ("norm", dict(norm="group"), r"norm must be one of"),
    ("eps", dict(norm="rms", eps=-1.0), r"eps must be >= 0"),
    ("clamp", dict(clamp=0.0), r"clamp must be None or > 0"),
    ("weight_numel", dict(norm="rms", norm_weight=torch.ones(8)), r"norm_weight must be 1-D with K=16"),
    ("mod_k", dict(mod_scale=torch.ones(2, 8)), r"mod_scale must be \[G, K=16\]"),
    ("mod_groups", dict(mod_shift=torch.ones(4, 16)), r"mod_shift has 4 rows, which must divide the 6"),
    ("mod_mismatch", dict(mod_scale=torch.ones(2, 16), mod_shift=torch.ones(3, 16)), r"same number of rows"),
    ("backend", dict(backend="cutlass"), r"backend must be one of"),
]


@pytest.mark.parametrize("change,match", [pytest.param(c, m, id=n) for n, c, m in BAD_ARGUMENTS])
def test_bad_arguments_raise_value_error(change, match):
    arguments = _valid()
    arguments.update(change)
    with pytest.raises(ValueError, match=match):
        quantize_per_token(**arguments)


def test_valid_arguments_are_accepted():
    quantize_per_token(**_valid(), backend="torch")


def test_unavailable_backends_name_the_reason():
    x = torch.randn(3, 16)
    reasons = supported_backends(x, "fp8")
    assert reasons["torch"] is None and reasons["cuda"] is not None
    if has_compiled_extension():
        match = r"backend='cuda' cannot take these inputs: .*needs CUDA tensors"
    else:
        match = r"backend='cuda' cannot take these inputs: omni_kernels\._C is not available"
    with pytest.raises(ValueError, match=match):
        quantize_per_token(x, "int8", backend="cuda")
    if triton_interpreter_enabled():
        with pytest.raises(ValueError, match=r"Triton interpreter has no float8"):
            quantize_per_token(x, "fp8", backend="triton")
        with pytest.raises(ValueError, match=r"bfloat16 is broken"):
            quantize_per_token(x.bfloat16(), "int8", backend="triton")


def test_auto_on_cpu():
    """On CPU auto takes Triton (interpreter) for INT8 and the reference for FP8."""
    x = torch.randn(3, 16)
    q, s = quantize_per_token(x, "fp8")
    q_ref, s_ref = quantize_per_token(x, "fp8", backend="torch")
    assert torch.equal(q.float(), q_ref.float()) and torch.equal(s, s_ref)
    q, s = quantize_per_token(x, "int8")
    assert torch.equal(q, quantize_per_token(x, "int8", backend="torch")[0])


def test_auto_order_follows_the_measured_crossover():
    """Fused (norm/modulation) rows: CUDA first at Flux's 4608 tokens of 3072, Triton first at
    Wan 720p's 75600 and for Flux's 4608 x 12288 MLP down input. Plain rows: CUDA (its
    shared-memory-staged kernel) first up to the widest row it stages (H200 measurements)."""
    from omni_kernels.quant.dispatch import CUDA_STAGED_MAX_ROW, auto_order

    assert auto_order(4608) == ("cuda", "triton", "torch")
    assert auto_order(4608, 3072) == ("cuda", "triton", "torch")
    assert auto_order(4608, 12288) == ("triton", "cuda", "torch")
    assert auto_order(75600, 5120) == ("triton", "cuda", "torch")
    for rows, k in ((4608, 3072), (4608, 12288), (75600, 13824), (7, CUDA_STAGED_MAX_ROW)):
        assert auto_order(rows, k, fused=False) == ("cuda", "triton", "torch")
    assert auto_order(4608, CUDA_STAGED_MAX_ROW + 8, fused=False) == ("triton", "cuda", "torch")
    assert supported_backends(torch.randn(2, 16)).keys() == {"cuda", "triton", "torch"}


# ============================================================================ CPU: torch.library / compile

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@needs_interpreter_or_gpu
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "adaln"])
def test_opcheck_triton_op(inputs, fused):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = inputs.activations((4, 32), torch.float32, device)
    mod = inputs.activations((2, 32), torch.float32, device, outlier_channels=0) if fused else None
    args = (x, None, None, mod, mod, 2 if fused else 0, 1e-6, 0.0, torch.int8)
    torch.library.opcheck(torch.ops.omni_kernels.quantize_per_token_triton, args, test_utils=OPCHECK_UTILS)


class _AdaLNQuant(torch.nn.Module):
    def __init__(self, backend):
        super().__init__()
        self.backend = backend

    def forward(self, x, emb):
        shift, scale = emb.chunk(2, dim=-1)
        q, s = quantize_per_token(x, "int8", norm="layer", mod_scale=scale, mod_shift=shift,
                                  backend=self.backend)
        return dequantize(q, s)


@needs_interpreter_or_gpu
@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(inputs, compile_backend):
    x = inputs.activations((2, 3, 32), torch.float32)
    emb = inputs.activations((2, 64), torch.float32, outlier_channels=0)
    module = _AdaLNQuant("triton")
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=compile_backend, fullgraph=True)
    torch.testing.assert_close(compiled(x, emb), module(x, emb), rtol=0, atol=0)


# ============================================================================ GPU


def _require_cuda_extension():
    if not has_compiled_extension():
        from omni_kernels._extension import compiled_extension_error

        message = f"backend='cuda' needs the compiled extension: {compiled_extension_error()}"
        if os.environ.get("OMNI_REQUIRE_CUDA_EXT", "0") not in ("", "0"):
            pytest.fail(message + " (OMNI_REQUIRE_CUDA_EXT=1 makes this a failure)")
        pytest.skip(message)


def _require_fp8(qdtype):
    if qdtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")


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
def test_gpu_opcheck_cuda_op(inputs):
    _require_cuda_extension()
    x = inputs.activations((64, 256), torch.bfloat16, "cuda")
    mod = inputs.activations((2, 256), torch.bfloat16, "cuda", outlier_channels=0)
    for args in (
        (x, None, None, None, None, 0, 1e-6, 0.0, torch.int8),
        (x, None, None, mod, mod, 2, 1e-6, 3.0, FP8_DTYPE if torch.cuda.get_device_capability() >= (8, 9) else torch.int8),
    ):
        torch.library.opcheck(torch.ops.omni_kernels.quantize_per_token, args, test_utils=OPCHECK_UTILS)


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


# ============================================================================ GELU-fused quantization

from omni_kernels.quant import (  # noqa: E402
    QuantizedLinear,
    quantize_activated_per_token,
    quantize_activated_reference,
)
from omni_kernels.quant.activated_triton_kernel import launch_quantize_activated_triton  # noqa: E402

# (rows, K, activation_from): odd widths, a prefix that does not end on a vector boundary,
# a row longer than one register tile is covered by the chunked test below.
ACTIVATED_SHAPES = [(7, 96, 0), (13, 200, 40), (5, 37, 5), (33, 1000, 999)]


def test_activated_reference_hand_made_row():
    """GELU(tanh) of [0, 1, -1, 3] is [0, 0.841192, -0.158808, 2.996363]; with the first column
    passed through, the row [-4, 1, -1, 3] has absolute maximum 4: INT8 scale 4/127."""
    x = torch.tensor([[-4.0, 1.0, -1.0, 3.0]])
    q, scale = quantize_activated_reference(x, torch.int8, "gelu_tanh", 1)
    assert scale.item() == pytest.approx(4 / 127, rel=1e-7)
    gelu = F.gelu(torch.tensor([1.0, -1.0, 3.0]), approximate="tanh")
    assert torch.allclose(gelu, torch.tensor([0.841192, -0.158808, 2.996363]), atol=1e-6)
    assert q.tolist() == [[-127] + torch.round(gelu * 127 / 4).to(torch.int8).tolist()]


@needs_interpreter_or_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows,k,activation_from", ACTIVATED_SHAPES)
def test_activated_triton_matches_reference(inputs, rows, k, activation_from, dtype):
    """INT8 from the Triton kernel (interpreter on CPU): scales within float32 rounding of the
    reference's (the kernel's tanh is exp-based), values within one step, rarely."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = inputs.activations((rows, k), dtype, device)
    q, scale = quantize_activated_per_token(x, "int8", activation_from=activation_from, backend="triton")
    q_ref, scale_ref = quantize_activated_reference(x, torch.int8, "gelu_tanh", activation_from)
    _assert_same_quantization(q, scale, q_ref, scale_ref, max_code_diff=1, max_diff_fraction=0.01,
                              scale_rtol=1e-6)


@needs_interpreter_or_gpu
def test_activated_triton_chunked_rows_and_clamp(inputs):
    """Rows longer than one register tile (forced small here) loop in chunks; clamp applies
    after the GELU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = inputs.activations((9, 300), torch.float32, device)
    q, scale = launch_quantize_activated_triton(x, 100, 2.5, torch.int8, max_tile=64)
    q_ref, scale_ref = quantize_activated_reference(x, torch.int8, "gelu_tanh", 100, clamp=2.5)
    _assert_same_quantization(q, scale, q_ref, scale_ref, max_code_diff=1, max_diff_fraction=0.01,
                              scale_rtol=1e-6)


def test_activated_equals_gelu_then_quantize(inputs):
    """The fused reference is the unfused computation: GELU on the columns, then quantize_per_token."""
    x = inputs.activations((11, 64), torch.float32)
    for activation_from in (0, 24):
        y = torch.cat([x[:, :activation_from], F.gelu(x[:, activation_from:], approximate="tanh")], 1)
        for qdtype in ("int8", "fp8"):
            q, scale = quantize_activated_per_token(x, qdtype, activation_from=activation_from, backend="torch")
            q_ref, scale_ref = quantize_per_token(y, qdtype, backend="torch")
            assert torch.equal(scale, scale_ref) and torch.equal(q.float(), q_ref.float())


@pytest.mark.parametrize("kwargs,match", [
    (dict(activation="relu"), "activation must be one of"),
    (dict(activation_from=64), r"activation_from must be an int in \[0, K=64\)"),
    (dict(activation_from=-1), "activation_from must be an int"),
    (dict(clamp=0.0), "clamp must be None or > 0"),
    (dict(backend="cutlass"), "backend must be one of"),
    (dict(backend="cuda"), "backend='cuda' cannot take these inputs: the CUDA kernel needs CUDA tensors"),
    (dict(dtype="fp16"), "dtype must be 'fp8'"),
])
def test_activated_bad_arguments(kwargs, match):
    x = torch.randn(4, 64)
    kwargs = {"dtype": "int8", **kwargs}
    with pytest.raises(ValueError, match=match):
        quantize_activated_per_token(x, kwargs.pop("dtype"), **kwargs)


@needs_interpreter_or_gpu
def test_opcheck_activated_op(inputs):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = inputs.activations((16, 96), torch.float32, device)
    torch.library.opcheck(torch.ops.omni_kernels.quantize_activated_triton, (x, 32, 0.0, torch.int8),
                          test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("activation_backend", ["torch", pytest.param("triton", marks=needs_interpreter_or_gpu)])
def test_quantized_linear_with_input_activation(inputs, activation_backend):
    """A W8A8 layer with input_activation is the plain quantized layer on cat(x[:, :a],
    GELU(x[:, a:])): equal with the torch backend, within one INT8 step of some activations with
    the Triton kernel (its tanh differs in the last float32 bits); weight-only layers and
    activation_backend="cuda" refuse it."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 48)
    x = inputs.activations((21, 96), torch.float32)
    layer = QuantizedLinear.from_linear(linear, "int8", activation_backend=activation_backend,
                                        input_activation="gelu_tanh", activation_from=32)
    plain = QuantizedLinear.from_linear(linear, "int8", activation_backend=activation_backend)
    activated = torch.cat([x[:, :32], F.gelu(x[:, 32:], approximate="tanh")], 1)
    out, expected = layer(x), plain(activated)
    if activation_backend == "torch":
        assert torch.equal(out, expected)
    else:
        assert ((out - expected).norm() / expected.norm()).item() <= 2e-3
    full = linear(activated)
    assert ((out - full).norm() / full.norm()).item() <= 0.05  # INT8 W8A8 with outlier channels
    assert "input_activation='gelu_tanh', activation_from=32" in repr(layer)
    with pytest.raises(ValueError, match="needs a W8A8 method"):
        QuantizedLinear.from_linear(linear, "int8_weight_only", input_activation="gelu_tanh")
    with pytest.raises(ValueError, match="activation_backend must be one of"):
        QuantizedLinear.from_linear(linear, "int8", activation_backend="cutlass", input_activation="gelu_tanh")
    cuda_layer = QuantizedLinear.from_linear(linear, "int8", activation_backend="cuda", input_activation="gelu_tanh")
    with pytest.raises(ValueError, match="backend='cuda' cannot take these inputs"):  # CPU tensors here
        cuda_layer(x)
    with pytest.raises(ValueError, match="forward_quantized takes an input already quantized"):
        layer.forward_quantized(torch.zeros(2, 96, dtype=torch.int8), torch.ones(2, 1), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("rows,k,activation_from", [
    pytest.param(4608, 15360, 3072, id="flux-single-proj_out"),
    pytest.param(4096, 12288, 0, id="flux-ff-down"),
    pytest.param(333, 13824, 0, id="wan-ffn-M333"),
    pytest.param(17, 20000, 77, id="chunked-odd"),
    # Past the CUDA op's shared-memory-staged kernel (48 KB of 16-bit values): its register kernel.
    pytest.param(5, 30000, 11, id="cuda-register-kernel-row"),
])
def test_gpu_activated_matches_reference(inputs, rows, k, activation_from, backend, dtype, qdtype):
    """On the GPU, at Flux/Wan MLP widths: scales within float32 rounding, values within one
    step in at most 1% of the elements (the kernel's exp-based tanh vs torch's)."""
    if backend == "cuda":
        _require_cuda_extension()
    _require_fp8(qdtype)
    x = inputs.activations((rows, k), dtype, "cuda")
    _poison_cuda_allocator(2 * x.numel())
    q, scale = quantize_activated_per_token(x, qdtype, activation_from=activation_from, backend=backend)
    torch.cuda.synchronize()
    q_ref, scale_ref = quantize_activated_reference(x, q.dtype, "gelu_tanh", activation_from)
    _assert_same_quantization(q, scale, q_ref, scale_ref, max_code_diff=1, max_diff_fraction=0.01,
                              scale_rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("clamp", [None, 0.08], ids=["no-clamp", "clamp"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_activated_rows_of_small_gelus_match_reference(inputs, backend, clamp):
    """Rows whose GELU stays small (every value below ~0.26, or all negative: the GELU's
    largest magnitude is then on its negative lobe, not at the row's maximum) beside ordinary
    rows, with a prefix of another scale: the CUDA kernel takes a row's maximum from its
    largest input only when that GELU exceeds the negative lobe's depth, so these rows take its
    other path."""
    if backend == "cuda":
        _require_cuda_extension()
    _require_fp8("fp8")
    rows, k, activation_from = 257, 6144, 1024
    x = inputs.activations((rows, k), torch.float32, "cuda")
    x[0::4] = x[0::4].abs().neg() * 0.9          # all negative: |GELU| peaks near x = -0.75
    x[1::4] = x[1::4] * 0.05                      # small: every GELU below the lobe's depth
    x[2::4, activation_from:] = x[2::4, activation_from:].clamp(max=0.2)
    x[2::4, :activation_from] *= 0.01             # prefix columns without the GELU, tiny
    x = x.to(torch.bfloat16)
    _poison_cuda_allocator(2 * x.numel())
    q, scale = quantize_activated_per_token(x, "fp8", activation_from=activation_from, clamp=clamp,
                                            backend=backend)
    torch.cuda.synchronize()
    q_ref, scale_ref = quantize_activated_reference(x, q.dtype, "gelu_tanh", activation_from, clamp=clamp)
    _assert_same_quantization(q, scale, q_ref, scale_ref, max_code_diff=1, max_diff_fraction=0.01,
                              scale_rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_activated_op_under_inductor(inputs, backend):
    """Inductor launches the triton_op's kernel from its own code, and calls the CUDA op: same
    output as eager."""
    if backend == "cuda":
        _require_cuda_extension()
    _require_fp8("fp8")
    x = inputs.activations((4608, 15360), torch.bfloat16, "cuda")

    def quantize(t):
        return quantize_activated_per_token(t, "fp8", activation_from=3072, backend=backend)

    eager = quantize(x)
    torch._dynamo.reset()
    compiled = torch.compile(quantize, fullgraph=True)(x)
    torch._dynamo.reset()
    assert torch.equal(compiled[1], eager[1]) and torch.equal(compiled[0].float(), eager[0].float())


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,clamp", [((4608, 3072), "fp8", None), ((2, 333, 1000), "int8", 6.0),
                                               ((3, 5000), "fp8", 2.5)], ids=["flux", "odd-int8-clamp", "chunked"])
def test_gpu_triton_op_under_inductor(inputs, shape, dtype, clamp):
    """Inductor traces the triton_op and launches its kernel itself (its float arguments typed
    fp64 there): LayerNorm + adaLN + quantization give the eager launch's codes and scales."""
    _require_fp8(dtype)
    x = inputs.activations(shape, torch.bfloat16, "cuda")
    emb = inputs.activations((shape[0], 2 * shape[-1]), torch.float32, "cuda", outlier_channels=0)
    weight = inputs.activations((shape[-1],), torch.float32, "cuda", outlier_channels=0)

    def quantize(t, e, w):
        shift, scale = e.chunk(2, dim=-1)
        return quantize_per_token(t, dtype, norm="layer", norm_weight=w, eps=1e-6, mod_scale=scale,
                                  mod_shift=shift, clamp=clamp, backend="triton")

    eager = quantize(x, emb, weight)
    torch._dynamo.reset()
    compiled = torch.compile(quantize, fullgraph=True)(x, emb, weight)
    torch._dynamo.reset()
    assert torch.equal(compiled[1], eager[1])
    assert torch.equal(compiled[0].view(torch.uint8), eager[0].view(torch.uint8))


# ============================================================================ GELU-fused quantization of cat(prefix, GELU(x))

from omni_kernels.quant.reference import activate_reference  # noqa: E402


def _same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _head_and_tail(inputs, lead, k0, k, dtype, device="cpu", tail_slice=False):
    """Flux's ``proj_out`` operands and their ``cat``: ``head`` ``[*lead, k0]`` (the attention
    output) a column slice of a wider tensor, its rows strided past their width; ``tail``
    ``[*lead, k]`` (the MLP's pre-activation), contiguous or also a slice. The head's rows are
    scaled from 1e-3x to 1e2x so that the row maximum lies in the head for some rows and in
    GELU(tail) for others."""
    rows = 1
    for size in lead:
        rows *= size
    ramp = torch.logspace(-3.0, 2.0, rows, device=device).reshape(*lead, 1)
    wide = (inputs.activations((*lead, k0 + 24), torch.float32, device) * ramp).to(dtype)
    head = wide[..., 16:16 + k0]
    tail = inputs.activations((*lead, k + 8 if tail_slice else k), dtype, device)
    if tail_slice:
        tail = tail[..., 8:]
    cat = torch.cat([head, tail], -1)
    head_max = head.float().abs().amax(-1)
    tail_max = F.gelu(tail.float(), approximate="tanh").abs().amax(-1)
    assert (head_max > tail_max).any() and (head_max < tail_max).any(), "both maxima sides covered"
    return head, tail, cat


_PREFIX_BACKENDS = [
    pytest.param("torch", "int8", id="torch-int8"),
    pytest.param("torch", "fp8", id="torch-fp8"),
    pytest.param("triton", "int8", id="triton-int8", marks=needs_interpreter_or_gpu),
    pytest.param("triton", "fp8", id="triton-fp8", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="the Triton interpreter has no float8")),
]


@pytest.mark.parametrize("clamp", [None, 2.5], ids=["no-clamp", "clamp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("backend,qdtype", _PREFIX_BACKENDS)
@pytest.mark.parametrize("lead,k0,k,tail_slice", [
    pytest.param((3, 5), 24, 40, False, id="B3-S5-K0_24-K40"),
    pytest.param((7,), 5, 37, True, id="M7-K0_5-K37-tail-slice"),
])
def test_activated_prefix_equals_materialized_cat(inputs, lead, k0, k, tail_slice, backend, qdtype, dtype,
                                                  clamp):
    """quantize_activated_per_token(tail, prefix=head) is the same backend on cat(head, tail) with
    activation_from=K0, bit for bit (scale and every value), with the head read through its
    strided rows; and (Triton) within one step of the float32 reference, rarely."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    head, tail, cat = _head_and_tail(inputs, lead, k0, k, dtype, device, tail_slice)
    assert head.stride(-2) > k0 and not head.is_contiguous()
    q, scale = quantize_activated_per_token(tail, qdtype, prefix=head, clamp=clamp, backend=backend)
    q_cat, scale_cat = quantize_activated_per_token(cat, qdtype, activation_from=k0, clamp=clamp, backend=backend)
    assert q.shape == (*lead, k0 + k) and scale.shape == (*lead, 1)
    assert torch.equal(scale, scale_cat) and _same_bits(q, q_cat)
    q_ref, scale_ref = quantize_activated_reference(cat.reshape(-1, k0 + k), q.dtype, "gelu_tanh", k0, clamp)
    _assert_same_quantization(q.reshape(-1, k0 + k), scale.reshape(-1, 1), q_ref, scale_ref, max_code_diff=1,
                              max_diff_fraction=0.01, scale_rtol=1e-6)


@needs_interpreter_or_gpu
@pytest.mark.parametrize("k0,k,clamp", [
    pytest.param(24, 40, 2.5, id="K0_24-K40-one-chunk"),
    pytest.param(2000, 2300, 0.0, id="K0_2000-K2300-prefix-in-chunk0"),
    pytest.param(4100, 60, 0.0, id="K0_4100-K60-prefix-ends-in-chunk1"),
])
def test_activated_prefix_chunked_rows(inputs, k0, k, clamp):
    """Rows past the register tile (forced small) go through 4096-wide chunks of cat(head, tail),
    a chunk straddling the two sources: equal to the kernel on the materialized cat (chunked) and
    to the prefix kernel's single-tile path; num_warps (a tuning knob) does not change values."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    head, tail, cat = _head_and_tail(inputs, (3,), k0, k, torch.float32, device)
    chunked = launch_quantize_activated_triton(tail, 0, clamp, torch.int8, prefix=head, max_tile=16)
    cat_chunked = launch_quantize_activated_triton(cat, k0, clamp, torch.int8, max_tile=16)
    tile = launch_quantize_activated_triton(tail, 0, clamp, torch.int8, prefix=head, num_warps=4)
    recomputed = launch_quantize_activated_triton(tail, 0, clamp, torch.int8, prefix=head, recompute_activation=True)
    for other in (cat_chunked, tile, recomputed):
        assert torch.equal(chunked[1], other[1]) and torch.equal(chunked[0], other[0])
    q_ref, scale_ref = quantize_activated_reference(cat, torch.int8, "gelu_tanh", k0, clamp or None)
    _assert_same_quantization(*chunked, q_ref, scale_ref, max_code_diff=1, max_diff_fraction=0.01,
                              scale_rtol=1e-6)


@needs_interpreter_or_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("activation_from,clamp", [(0, 0.0), (37, 3.0)])
def test_activated_recompute_gives_the_same_codes(inputs, dtype, activation_from, clamp):
    """recompute_activation (a register-pressure knob: the GELU applied again for the store)
    writes the same codes and scales as keeping the activated row."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(inputs.seed)
    x = (torch.randn(7, 333, device=device) * 3).to(dtype)
    x[:, 5] *= 20  # an outlier channel
    kept = launch_quantize_activated_triton(x, activation_from, clamp, torch.int8)
    again = launch_quantize_activated_triton(x, activation_from, clamp, torch.int8, recompute_activation=True)
    assert torch.equal(kept[1], again[1]) and torch.equal(kept[0], again[0])
    q_ref, scale_ref = quantize_activated_reference(x, torch.int8, "gelu_tanh", activation_from, clamp or None)
    _assert_same_quantization(*again, q_ref, scale_ref, max_code_diff=1, max_diff_fraction=0.01, scale_rtol=1e-5)



@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", ["fp8", "int8"])
@pytest.mark.parametrize("lead,k0,k,tail_slice", [
    pytest.param((3, 5), 24, 40, True, id="B3-S5-K0_24-K40-tail-slice"),
    pytest.param((4608,), 3072, 12288, False, id="flux-single-proj_out"),
])
def test_gpu_cuda_activated_prefix_equals_materialized_cat(inputs, lead, k0, k, tail_slice, qdtype):
    """The CUDA kernel on (prefix=head, tail) equals it on cat(head, tail) with activation_from=K0
    bit for bit (the head read through its strided rows), and the float32 reference within one
    step in at most 1% of the values."""
    _require_cuda_extension()
    _require_fp8(qdtype)
    head, tail, cat = _head_and_tail(inputs, lead, k0, k, torch.bfloat16, "cuda", tail_slice)
    _poison_cuda_allocator(4 * cat.numel())
    q, scale = quantize_activated_per_token(tail, qdtype, prefix=head, backend="cuda")
    q_cat, scale_cat = quantize_activated_per_token(cat, qdtype, activation_from=k0, backend="cuda")
    torch.cuda.synchronize()
    assert torch.equal(scale, scale_cat) and _same_bits(q, q_cat)
    q_ref, scale_ref = quantize_activated_reference(cat.reshape(-1, k0 + k), q.dtype, "gelu_tanh", k0)
    _assert_same_quantization(q.reshape(-1, k0 + k), scale.reshape(-1, 1), q_ref, scale_ref, max_code_diff=1,
                              max_diff_fraction=0.01, scale_rtol=1e-5)


@pytest.mark.gpu
def test_gpu_opcheck_cuda_activated_op(inputs):
    _require_cuda_extension()
    x = inputs.activations((64, 256), torch.bfloat16, "cuda")
    head = inputs.activations((64, 48), torch.bfloat16, "cuda")
    for args in ((x, None, 32, 0.0, torch.int8), (x, head, 0, 3.0, torch.int8)):
        torch.library.opcheck(torch.ops.omni_kernels.quantize_activated, args, test_utils=OPCHECK_UTILS)


@pytest.mark.gpu
def test_gpu_cuda_activated_refuses_what_it_cannot_take(inputs):
    """auto falls back to Triton for widths that are not multiples of 8; backend='cuda' names why."""
    _require_cuda_extension()
    x = inputs.activations((8, 100), torch.bfloat16, "cuda")[:, :99]
    with pytest.raises(ValueError, match="multiples of 8"):
        quantize_activated_per_token(x, "int8", backend="cuda")
    q, scale = quantize_activated_per_token(x, "int8")
    q_ref, scale_ref = quantize_activated_reference(x, torch.int8, "gelu_tanh", 0)
    _assert_same_quantization(q, scale, q_ref, scale_ref, max_code_diff=1, max_diff_fraction=0.05, scale_rtol=1e-5)

def test_activated_prefix_bad_arguments():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"prefix \[\.\.\., K0\] must have x's leading shape \(4,\); got \(5, 8\)"):
        quantize_activated_per_token(x, "int8", prefix=torch.randn(5, 8), backend="torch")
    with pytest.raises(ValueError, match=r"leading shape \(4,\); got \(4, 1, 8\)"):
        quantize_activated_per_token(x, "int8", prefix=torch.randn(4, 1, 8), backend="torch")
    with pytest.raises(ValueError, match=r"prefix must have x's dtype torch.float32; got torch.float16"):
        quantize_activated_per_token(x, "int8", prefix=torch.randn(4, 8, dtype=torch.float16), backend="torch")
    with pytest.raises(ValueError, match=r"prefix must be on x's device cpu; got meta"):
        quantize_activated_per_token(x, "int8", prefix=torch.empty(4, 8, device="meta"), backend="torch")
    with pytest.raises(ValueError, match=r"prefix must be None or a tensor \[\.\.\., K0\]; got list"):
        quantize_activated_per_token(x, "int8", prefix=[[0.0] * 8] * 4, backend="torch")
    with pytest.raises(ValueError, match=r"activation_from must be 0 with a prefix .*; got 3"):
        quantize_activated_per_token(x, "int8", prefix=torch.randn(4, 8), activation_from=3, backend="torch")
    with pytest.raises(ValueError, match=r"num_warps must be None or a power of two from 1 to 32; got 3"):
        launch_quantize_activated_triton(x, 0, 0.0, torch.int8, prefix=torch.randn(4, 8), num_warps=3)


def test_activated_prefix_empty_parts(inputs):
    """An empty head is the plain activated quantization of the tail; an empty batch gives empty outputs."""
    tail = inputs.activations((6, 40), torch.float32)
    q, scale = quantize_activated_per_token(tail, "int8", prefix=tail[:, :0], backend="torch")
    q_plain, scale_plain = quantize_activated_per_token(tail, "int8", backend="torch")
    assert torch.equal(q, q_plain) and torch.equal(scale, scale_plain)
    q, scale = quantize_activated_per_token(tail[:0], "int8", prefix=tail[:0, :8], backend="torch")
    assert q.shape == (0, 48) and scale.shape == (0, 1)
    if triton_interpreter_enabled() or torch.cuda.is_available():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        tail = tail.to(device)
        q, scale = quantize_activated_per_token(tail, "int8", prefix=tail[:, :0], backend="triton")
        q_plain, scale_plain = quantize_activated_per_token(tail, "int8", backend="triton")
        assert torch.equal(q, q_plain) and torch.equal(scale, scale_plain)


@needs_interpreter_or_gpu
def test_opcheck_activated_concat_op(inputs):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wide = inputs.activations((16, 64), torch.float32, device)
    x = inputs.activations((16, 40), torch.float32, device)
    for prefix in (wide[:, :24], wide[:, 8:32].contiguous()):
        torch.library.opcheck(torch.ops.omni_kernels.quantize_activated_concat_triton,
                              (prefix, x, 2.0, torch.int8), test_utils=OPCHECK_UTILS)


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows,k0,k,head_slice", [
    pytest.param(4608, 3072, 12288, False, id="flux-single-proj_out"),
    pytest.param(4097, 3072, 12288, True, id="flux-M4097-head-slice"),
    pytest.param(17, 3072, 20000, True, id="chunked-odd"),
])
def test_gpu_activated_prefix_matches_materialized_cat(inputs, rel_err, rows, k0, k, head_slice, dtype, qdtype):
    """At Flux's single-block proj_out width (3072 attention + 12288 MLP columns): the prefix
    kernel equals the kernel on the materialized cat bit for bit, and its dequantized output is
    as close to the float32 activated cat as the float32 reference quantization is."""
    _require_fp8(qdtype)
    if head_slice:
        head = inputs.activations((rows, k0 + 64), dtype, "cuda")[:, 64:]
    else:
        head = inputs.activations((rows, k0), dtype, "cuda")
    tail = inputs.activations((rows, k), dtype, "cuda")
    _poison_cuda_allocator(2 * rows * (k0 + k))
    q, scale = quantize_activated_per_token(tail, qdtype, prefix=head, backend="triton")
    torch.cuda.synchronize()
    cat = torch.cat([head, tail], -1)
    _poison_cuda_allocator(2 * rows * (k0 + k))
    q_cat, scale_cat = quantize_activated_per_token(cat, qdtype, activation_from=k0, backend="triton")
    torch.cuda.synchronize()
    assert torch.isfinite(scale).all() and not torch.isnan(q.float()).any()
    assert torch.equal(scale, scale_cat) and _same_bits(q, q_cat)
    y = activate_reference(cat, "gelu_tanh", k0)
    q_ref, scale_ref = quantize_activated_reference(cat, q.dtype, "gelu_tanh", k0)
    _assert_same_quantization(q, scale, q_ref, scale_ref, max_code_diff=1, max_diff_fraction=0.01,
                              scale_rtol=1e-5)
    err, err_ref = rel_err(dequantize(q, scale), y), rel_err(dequantize(q_ref, scale_ref), y)
    assert err <= 1.01 * err_ref + 1e-6, f"relative error {err:.4e} vs the reference quantization's {err_ref:.4e}"


@pytest.mark.gpu
def test_gpu_activated_prefix_op_under_inductor(inputs):
    """Inductor launches the concat triton_op's kernel itself, the head a column slice of a wider
    tensor inside the compiled graph (its row stride must reach the kernel): same as eager."""
    _require_fp8("fp8")
    wide = inputs.activations((4608, 3072 + 128), torch.bfloat16, "cuda")
    tail = inputs.activations((4608, 12288), torch.bfloat16, "cuda")

    def quantize(wide, tail):
        return quantize_activated_per_token(tail, "fp8", prefix=wide[:, 64:64 + 3072])

    eager = quantize(wide, tail)
    torch._dynamo.reset()
    compiled = torch.compile(quantize, fullgraph=True)(wide, tail)
    torch._dynamo.reset()
    assert torch.equal(compiled[1], eager[1]) and _same_bits(compiled[0], eager[0])
