"""Tests of the activation-quantization backend of :class:`QuantizedLinear` under
``torch.compile``.

CPU part (CI): :func:`resolve_activation_backend`; ``"auto"`` traces plain torch ops (no omni
custom op in the graph) and Inductor's fused code gives eager's result; an explicit kernel
backend stays omni's op; ``"split"`` traces omni's op for the layers wider than ``split_k``
only.

GPU part (``-m gpu``): Inductor's fused LayerNorm + modulation + FP8 quantization against the
eager CUDA kernel at Flux's width.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omni_kernels.quant import QuantizedLinear, resolve_activation_backend
from omni_kernels.quant.dispatch import supported_backends
from omni_kernels.quant.linear import DEFAULT_SPLIT_K

from quant_linear_cases import (
    GPU_LAYER_TOLERANCE,
    _Block,
    _dynamo_graphs,
    _omni_quantize_ops,
    _rel,
    needs_interpreter,
)


class _AdaLNBlock(nn.Module):
    """A DiT block's input side: LayerNorm + adaLN modulation read by two linears (as q and k of
    an attention), then a GELU read by a third: every quantized input comes from a fusable op."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.down = nn.Linear(dim, dim)

    def forward(self, x, shift, scale):
        h = self.norm(x) * (1 + scale) + shift
        return self.down(torch.nn.functional.gelu(self.q(h), approximate="tanh")) + self.k(h)


def _quantized_adaln_block(inputs, method, activation_backend, dim=32, device="cpu"):
    torch.manual_seed(inputs.seed)
    block = _AdaLNBlock(dim).to(device).eval()
    for name in ("q", "k", "down"):
        setattr(block, name, QuantizedLinear.from_linear(
            getattr(block, name), method, backend="aten", activation_backend=activation_backend))
    return block


def test_resolve_activation_backend():
    assert resolve_activation_backend("auto") == "auto"  # eager: the kernels' own auto choice
    assert resolve_activation_backend("triton") == "triton"

    def probe(x):
        return x + (1.0 if resolve_activation_backend("auto") == "torch" else 0.0) \
            + (10.0 if resolve_activation_backend("cuda") == "cuda" else 0.0)

    torch._dynamo.reset()
    out = torch.compile(probe, backend="eager", fullgraph=True)(torch.zeros(2))
    torch._dynamo.reset()
    assert torch.equal(out, torch.full((2,), 11.0))


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_compiled_auto_activation_quantization_is_plain_torch_ops(inputs, method):
    """Under torch.compile, activation_backend="auto" traces no omni custom op (Inductor can fuse
    the quantization into the LayerNorm/modulation/GELU that produces the input), and the traced
    torch ops give the eager layer's result exactly (the same reference math)."""
    block = _quantized_adaln_block(inputs, method, "auto")
    x = inputs.activations((2, 9, 32), torch.float32)
    shift, scale = torch.randn(2, 1, 32), torch.randn(2, 1, 32) * 0.3
    graphs, out = _dynamo_graphs(block, x, shift, scale)
    assert len(graphs) == 1 and _omni_quantize_ops(graphs[0]) == []
    with torch.no_grad():
        torch.testing.assert_close(out, block(x, shift, scale), rtol=1e-6, atol=1e-6)


@needs_interpreter
def test_explicit_kernel_backend_stays_a_custom_op_under_compile(inputs):
    """The graph check above can fail: an explicit kernel backend is traced as omni's op."""
    block = _quantized_adaln_block(inputs, "int8", "triton")
    x = inputs.activations((2, 9, 32), torch.float32)
    graphs, _ = _dynamo_graphs(block, x, torch.zeros(2, 1, 32), torch.zeros(2, 1, 32))
    assert _omni_quantize_ops(graphs[0]) == ["omni_kernels.quantize_per_token_triton"] * 3


# Inductor evaluates the LayerNorm/modulation in its own fused order, so a quantized value may
# land on the other side of a rounding boundary now and then (one INT8/FP8 step of one element:
# ~3e-4 relative L2 here); measured 0 to 6e-8 on CPU. The bound is far below the quantization
# error itself (MODULE_TOLERANCE).
COMPILED_VS_EAGER = 2e-3


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_inductor_compiled_block_matches_eager(inputs, method):
    block = _quantized_adaln_block(inputs, method, "auto")
    x = inputs.activations((2, 9, 32), torch.float32)
    shift, scale = torch.randn(2, 1, 32), torch.randn(2, 1, 32) * 0.3
    with torch.no_grad():
        eager = block(x, shift, scale)
        torch._dynamo.reset()
        try:
            compiled = torch.compile(block, backend="inductor", fullgraph=True)(x, shift, scale)
        finally:
            torch._dynamo.reset()
    assert _rel(compiled, eager) <= COMPILED_VS_EAGER


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(activation_backend="fused"), r"activation_backend must be one of \('auto', 'cuda', 'triton', 'torch', 'split'\); got 'fused'"),
        (dict(activation_backend="split", split_k=-1), r"split_k must be None or an int >= 0 \(an input width K\); got -1"),
        (dict(activation_backend="split", split_k="8192"), r"split_k must be None or an int >= 0"),
        (dict(activation_backend="split", split_k=True), r"split_k must be None or an int >= 0"),
        (dict(split_k=64), r"split_k=64 applies only to activation_backend='split'; got activation_backend='auto'"),
    ],
)
def test_split_activation_backend_options_validate(options, match):
    with pytest.raises(ValueError, match=match):
        QuantizedLinear(32, 32, method="int8", **options)


def test_split_activation_backend_defaults_and_resolution():
    assert QuantizedLinear(32, 32, method="int8", activation_backend="split").split_k == DEFAULT_SPLIT_K == 8192
    assert QuantizedLinear(32, 32, method="int8").split_k is None
    # Eager: "split" is "auto" (the kernels' own choice) at any width.
    assert resolve_activation_backend("split", 16384, 8192) == "auto"
    assert resolve_activation_backend("split", 64) == "auto"
    with pytest.raises(ValueError, match=r"activation_backend='split' needs the layer's input width k"):
        resolve_activation_backend("split")

    def probe(x):  # under compile: torch ops up to split_k (inclusive), the kernels above
        return (x + (1.0 if resolve_activation_backend("split", 32, 32) == "torch" else 0.0)
                + (10.0 if resolve_activation_backend("split", 33, 32) == "auto" else 0.0)
                + (100.0 if resolve_activation_backend("split", DEFAULT_SPLIT_K + 1) == "auto" else 0.0))

    torch._dynamo.reset()
    out = torch.compile(probe, backend="eager", fullgraph=True)(torch.zeros(2))
    torch._dynamo.reset()
    assert torch.equal(out, torch.full((2,), 111.0))


def _split_block(inputs, split_k):
    """_Block (up: K=32, down: K=64), INT8, activation_backend="split" with ``split_k``."""
    torch.manual_seed(inputs.seed)
    block = _Block().eval()
    for name in ("up", "down"):
        setattr(block, name, QuantizedLinear.from_linear(
            getattr(block, name), "int8", backend="aten", activation_backend="split", split_k=split_k))
    return block


@needs_interpreter
@pytest.mark.parametrize("split_k,kernel_layers", [(0, 2), (32, 1), (64, 0)])
def test_split_activation_backend_traces_the_kernel_op_for_wide_layers_only(inputs, split_k, kernel_layers):
    """Under compile, "split" traces omni's op only for layers wider than split_k (here the
    K=64 ``down`` at split_k=32), and the graph gives eager's result (eager runs the kernel for
    both). On CPU the kernels' "auto" order takes the Triton kernel (interpreter, float32): the
    CUDA kernel needs CUDA tensors. On a GPU the op would be the CUDA one."""
    x = inputs.activations((2, 5, 32), torch.float32)
    reasons = supported_backends(x, "int8")
    assert reasons["cuda"] is not None and reasons["triton"] is None
    block = _split_block(inputs, split_k)
    graphs, out = _dynamo_graphs(block, x)
    assert len(graphs) == 1
    assert _omni_quantize_ops(graphs[0]) == ["omni_kernels.quantize_per_token_triton"] * kernel_layers
    with torch.no_grad():
        eager = block(x)
    assert _rel(out, eager) <= COMPILED_VS_EAGER


@needs_interpreter
def test_inductor_compiled_split_block_matches_eager(inputs):
    block = _split_block(inputs, 32)
    x = inputs.activations((2, 5, 32), torch.float32)
    with torch.no_grad():
        eager = block(x)
        torch._dynamo.reset()
        try:
            compiled = torch.compile(block, backend="inductor", fullgraph=True)(x)
        finally:
            torch._dynamo.reset()
    assert _rel(compiled, eager) <= COMPILED_VS_EAGER


# ============================================================================ GPU


@pytest.mark.gpu
def test_gpu_inductor_fused_quantization_matches_the_cuda_kernel(inputs):
    """Flux's width and token count (4608 x 3072, bf16, FP8): the block compiled by Inductor
    (activation quantization as torch ops fused into the LayerNorm/modulation/GELU) is as
    close to the unquantized float32 block as the eager block (omni's quantization kernel)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    torch.manual_seed(inputs.seed)
    reference_block = _AdaLNBlock(3072).cuda().eval()
    block = _quantized_adaln_block(inputs, "fp8", "auto", dim=3072, device="cuda").to(torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(inputs.seed)
    x = torch.randn(1, 4608, 3072, device="cuda", generator=gen).to(torch.bfloat16)
    shift = torch.randn(1, 1, 3072, device="cuda", generator=gen).to(torch.bfloat16)
    scale = (0.3 * torch.randn(1, 1, 3072, device="cuda", generator=gen)).to(torch.bfloat16)
    graphs, _ = _dynamo_graphs(block, x, shift, scale)
    assert _omni_quantize_ops(graphs[0]) == []
    with torch.no_grad():
        ref = reference_block(x.float(), shift.float(), scale.float())
        eager = block(x, shift, scale)
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True)(x, shift, scale)
        torch._dynamo.reset()
    # Eager rounds the LayerNorm/modulation output to bf16 before quantizing, Inductor's fused
    # kernel quantizes its float32 value: ~3% of the FP8 values move one step (a CPU emulation
    # of one 3072 x 3072 layer: 1.7% relative L2 between the two). Neither is the more exact
    # by more than that; both keep FP8's own error (GPU_LAYER_TOLERANCE).
    err_eager, err_compiled = _rel(eager, ref), _rel(compiled, ref)
    print(f"FP8 block vs float32: eager {err_eager:.4f}, Inductor {err_compiled:.4f}, "
          f"between them {_rel(compiled, eager):.4f}")
    assert err_compiled <= 1.1 * err_eager + 0.005
    assert err_compiled <= GPU_LAYER_TOLERANCE["fp8"]
