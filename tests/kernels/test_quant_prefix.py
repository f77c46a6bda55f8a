"""Per-token quantization of ``cat([prefix, x], dim=-2)`` read in place (``quantize_per_token(...,
prefix=...)``): a joint text + image sequence held as two tensors, the cat never written.

The Triton kernel's prefix rows must be bit for bit those of the same kernel on the
materialized cat (same rows, same arithmetic): checked under the interpreter (fp16/fp32) and on
the GPU (bf16, FP8/INT8, LayerNorm + adaLN, clamp, odd and chunked widths, a batch of samples
with their own tables), against the torch reference, through the op (opcheck) and under Inductor.
"""

from __future__ import annotations

import pytest
import torch

from omni_kernels._triton import triton_interpreter_enabled
from omni_kernels.quant import quantize_per_token

needs_interpreter_or_gpu = pytest.mark.skipif(
    not (triton_interpreter_enabled() or torch.cuda.is_available()),
    reason="the Triton kernel needs a GPU or TRITON_INTERPRET=1",
)

# (batch, prefix rows, x rows, K): odd sizes; the last one takes the chunked (long-row) path
CASES = [(2, 3, 5, 40), (1, 4, 7, 96), (3, 1, 2, 33), (2, 2, 3, 20000)]


def _operands(inputs, batch, p, s, k, dtype, device, fused):
    x = inputs.activations((batch, s, k), dtype, device)
    prefix = inputs.activations((batch, p, k), dtype, device)
    if not fused:
        return x, prefix, {}
    tables = inputs.activations((batch, 2 * k), torch.float32, device, outlier_channels=0)
    shift, scale = tables.chunk(2, dim=-1)
    weight = inputs.activations((k,), torch.float32, device, outlier_channels=0)
    return x, prefix, dict(norm="layer", norm_weight=weight, eps=1e-6, mod_scale=scale, mod_shift=shift, clamp=6.0)


def _same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@needs_interpreter_or_gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "layernorm-adaln"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefix_rows_are_those_of_the_cat(inputs, case, fused, dtype):
    """Every row (the op allocates its outputs: nothing to poison), codes and scales bit for bit,
    against the kernel on the cat; and against the torch reference (codes within one step,
    scales within float32 rounding of the row statistics)."""
    if torch.cuda.is_available() and dtype == torch.float16:
        dtype = torch.bfloat16  # the GPU runs the dtype the models use
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, p, s, k = case
    x, prefix, kwargs = _operands(inputs, batch, p, s, k, dtype, device, fused)
    q, scale = quantize_per_token(x, "int8", prefix=prefix, backend="triton", **kwargs)
    q_cat, scale_cat = quantize_per_token(torch.cat([prefix, x], dim=1), "int8", backend="triton", **kwargs)
    assert q.shape == (batch, p + s, k) and scale.shape == (batch, p + s, 1)
    assert _same_bits(q, q_cat) and _same_bits(scale, scale_cat)
    q_ref, scale_ref = quantize_per_token(x, "int8", prefix=prefix, backend="torch", **kwargs)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-5, atol=0)
    assert (q.int() - q_ref.int()).abs().max() <= 1


@needs_interpreter_or_gpu
def test_prefix_on_two_dim_inputs_and_fp8(inputs):
    """``[P, K]`` and ``[S, K]`` (no batch dims): one sample; FP8 where the device has it."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    qdtype = "fp8" if device == "cuda" and torch.cuda.get_device_capability() >= (8, 9) else "int8"
    x = inputs.activations((9, 64), dtype, device)
    prefix = inputs.activations((4, 64), dtype, device)
    q, scale = quantize_per_token(x, qdtype, prefix=prefix, backend="triton")
    q_cat, scale_cat = quantize_per_token(torch.cat([prefix, x]), qdtype, backend="triton")
    assert _same_bits(q, q_cat) and _same_bits(scale, scale_cat)


@needs_interpreter_or_gpu
def test_opcheck_concat_op(inputs):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = inputs.activations((6, 32), torch.float32, device)
    prefix = inputs.activations((4, 32), torch.float32, device)
    mod = inputs.activations((2, 32), torch.float32, device, outlier_channels=0)
    args = (prefix, x, None, None, mod, mod, 2, 1e-6, 0.0, torch.int8, 2)
    torch.library.opcheck(torch.ops.omni_kernels.quantize_per_token_concat_triton, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


BAD_PREFIX = [
    ("other-k", lambda x: torch.zeros(2, 3, 7), r"prefix must be \[\.\.\., P, K\] with x \[\.\.\., S, K\]"),
    ("other-batch", lambda x: torch.zeros(3, 3, 8), r"same leading dims and K"),
    ("one-dim", lambda x: torch.zeros(8), r"prefix must be \[\.\.\., P, K\]"),
    ("dtype", lambda x: torch.zeros(2, 3, 8, dtype=torch.float64), r"prefix must be torch.float32 on cpu like x"),
]


@pytest.mark.parametrize("name,make,message", BAD_PREFIX, ids=[b[0] for b in BAD_PREFIX])
def test_bad_prefix_raises(name, make, message):
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=message):
        quantize_per_token(x, "int8", prefix=make(x), backend="torch")


def test_prefix_tables_must_cover_whole_samples_and_cuda_cannot_take_it():
    x, prefix = torch.randn(2, 5, 8), torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"must divide the batch 2 \(whole samples a table\); got 5 rows"):
        quantize_per_token(x, "int8", prefix=prefix, norm="layer", mod_scale=torch.randn(5, 8), backend="torch")
    with pytest.raises(ValueError, match=r"the CUDA kernel reads one input tensor, not a prefix and x apart"):
        quantize_per_token(x, "int8", prefix=prefix, backend="cuda")
    # the torch backend on the CPU: the cat's quantization
    q, scale = quantize_per_token(x, "int8", prefix=prefix, backend="torch")
    q_cat, scale_cat = quantize_per_token(torch.cat([prefix, x], 1), "int8", backend="torch")
    assert torch.equal(q, q_cat) and torch.equal(scale, scale_cat)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [3072, 15360])
def test_gpu_prefix_flux_shape_and_under_inductor(inputs, k):
    """Flux's single-block input (512 text + 4096 image tokens, FP8, LayerNorm + adaLN): the
    prefix launch equals the cat's, eager and with Inductor launching the triton_op's kernel."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
    x, prefix, kwargs = _operands(inputs, 1, 512, 4096, k, torch.bfloat16, "cuda", True)

    def quantize(a, b):
        return quantize_per_token(a, "fp8", prefix=b, backend="triton", **kwargs)

    eager = quantize(x, prefix)
    q_cat, scale_cat = quantize_per_token(torch.cat([prefix, x], 1), "fp8", backend="triton", **kwargs)
    assert _same_bits(eager[0], q_cat) and _same_bits(eager[1], scale_cat)
    torch._dynamo.reset()
    compiled = torch.compile(quantize, fullgraph=True)(x, prefix)
    torch._dynamo.reset()
    assert _same_bits(compiled[0], eager[0]) and _same_bits(compiled[1], eager[1])
