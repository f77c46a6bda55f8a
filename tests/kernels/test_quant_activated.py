"""Tests of GELU-fused per-token quantization (:func:`quantize_activated_per_token`): the
columns from ``activation_from`` on go through GELU(tanh) before the quantization.

CPU part (CI): the reference on a hand-made row and against the unfused computation; the
Triton kernel (interpreter) against the reference, chunked rows, clamp, the recomputed
activation; argument checks; opcheck; :class:`QuantizedLinear` with ``input_activation``.
With ``prefix=`` (``cat(prefix, GELU(x))`` read in place: Flux's single-block ``proj_out``
input, the cat never written): bit for bit the same backend on the materialized cat (the head
read through its strided rows), chunked rows straddling the two sources, argument checks,
empty parts, opcheck.

GPU part (``-m gpu``): the CUDA and Triton kernels at Flux/Wan MLP widths, rows of small GELUs,
the CUDA op's opcheck and refusals, the prefix kernels against the materialized cat and the
reference at Flux's widths, and the ops under Inductor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omni_kernels._triton import triton_interpreter_enabled
from omni_kernels.quant import (
    QuantizedLinear,
    dequantize,
    quantize_activated_per_token,
    quantize_activated_reference,
    quantize_per_token,
)
from omni_kernels.quant.activated_triton_kernel import launch_quantize_activated_triton
from omni_kernels.quant.reference import activate_reference

from quant_per_token_cases import (
    OPCHECK_UTILS,
    _assert_same_quantization,
    _poison_cuda_allocator,
    _require_cuda_extension,
    _require_fp8,
    needs_interpreter_or_gpu,
)


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


# ============================================================================ GPU


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


# ============================================================================ GELU-fused quantization of cat(prefix, GELU(x))


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


# ============================================================================ GPU


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
