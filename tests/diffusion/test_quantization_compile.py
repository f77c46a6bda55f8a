"""Tests of quantized tiny transformers under ``torch.compile`` (CPU, CI): quantized blocks
compile with ``fullgraph=True``; with fused projections no omni quantization op is traced and
Inductor's code gives eager's output; a kernel backend traces its op; the ``"split"``
activation backend reaches the layers and traces the op for wide inputs only.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

import omni_kernels.quant.dispatch as quant_dispatch  # noqa: E402
from omni_diffusion.quantization import QuantConfig, quantize, quantized_layers  # noqa: E402
from omni_kernels.quant import QuantizedLinear  # noqa: E402

from quantization_cases import CPU_OPTIONS, _rel, _run, _tiny_flux  # noqa: E402


@pytest.mark.parametrize("method,options", [("fp8", CPU_OPTIONS), ("int8", {})], ids=["fp8-aten", "int8-auto"])
def test_quantized_blocks_compile_fullgraph(method, options):
    """torch.compile(fullgraph=True) of the repeated blocks (regional compilation, as the
    runtime compiles) traces through the quantized layers of real diffusers blocks."""
    model, inputs = _tiny_flux()
    quantize(model, QuantConfig(method=method, **options))
    expected = _run(model, inputs)
    torch._dynamo.reset()
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.compile(backend="aot_eager", fullgraph=True)
    try:
        torch.testing.assert_close(_run(model, inputs), expected, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()


# Inductor evaluates norms and modulation in its own fused order, so a quantized value may
# cross a rounding boundary now and then (one step of one element ~3e-4 relative L2 at these
# sizes); measured 6e-8 (INT8) and 0 (FP8). Far below the quantization error (MODEL_TOLERANCE).
COMPILED_VS_EAGER = 2e-3


def _quantize_ops_traced(model, inputs):
    """omni quantization custom ops in the Dynamo graphs of the compiled blocks, and the output."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.compile(backend=record, fullgraph=True)
    try:
        out = _run(model, inputs)
    finally:
        torch._dynamo.reset()
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block._compiled_call_impl = None
    ops = [str(n.target) for g in graphs for n in g.graph.nodes
           if n.op == "call_function" and "omni_kernels" in str(n.target) and "quantize" in str(n.target)]
    return graphs, ops, out


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_compiled_fused_blocks_trace_no_quantize_op_and_match_eager(method):
    """Regional compile of fused, quantized Flux blocks with the default activation backend:
    no omni quantization op in the traced graphs (the quantization is torch ops Inductor fuses
    into the producing kernel), the traced graphs give eager's output, and so does Inductor."""
    model, inputs = _tiny_flux()
    quantize(model, QuantConfig(method=method, backend="aten", fuse_activations=False))
    eager = _run(model, inputs)
    graphs, ops, traced = _quantize_ops_traced(model, inputs)
    assert len(graphs) == 2 and ops == []
    torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.compile(backend="inductor", fullgraph=True)
    try:
        compiled = _run(model, inputs)
    finally:
        torch._dynamo.reset()
    assert _rel(compiled, eager) <= COMPILED_VS_EAGER


@pytest.mark.skipif(not quant_dispatch.triton_interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
def test_compiled_blocks_with_a_kernel_backend_trace_its_op():
    """The graph check can fail: an explicit kernel backend shows up as omni's op, once per
    quantized input (the fused q/k/v count once)."""
    model, inputs = _tiny_flux()
    quantize(model, QuantConfig(method="int8", backend="aten", activation_backend="triton", fuse_activations=False))
    block_layers = [n for n in quantized_layers(model) if "transformer_blocks" in n]
    _, ops, _ = _quantize_ops_traced(model, inputs)
    assert len(ops) == len(block_layers) and set(ops) == {"omni_kernels.quantize_per_token_triton"}


def test_split_activation_backend_config_reaches_the_layers():
    config = QuantConfig(method="int8", activation_backend="split", split_k=40)
    assert QuantConfig.from_dict(config.to_dict()) == config
    assert QuantConfig(activation_backend="split").split_k is None  # the layers' default, 8192
    model, _ = _tiny_flux()
    quantize(model, config)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.activation_backend == "split" and m.split_k == 40 for m in layers)
    model, _ = _tiny_flux()
    quantize(model, QuantConfig(method="int8", activation_backend="split"))
    assert {m.split_k for m in model.modules() if isinstance(m, QuantizedLinear)} == {8192}


@pytest.mark.skipif(not quant_dispatch.triton_interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("split_k", [40, 128])
def test_compiled_blocks_with_split_activation_backend_trace_the_op_for_wide_inputs_only(split_k):
    """activation_backend="split" under compile: omni's op once per block layer wider than
    split_k (split_k=128: the single block's proj_out, whose input is cat(attention, GELU(mlp)),
    K=160; 40: also the two MLP down projections, K=128), torch ops for the rest. On CPU the
    op is the Triton kernel under the interpreter (the CUDA kernel needs CUDA tensors; on a GPU
    it would be the CUDA op). The traced blocks give eager's output, where every layer runs the
    kernel."""
    model, inputs = _tiny_flux()
    quantize(model, QuantConfig(method="int8", backend="aten", activation_backend="split", split_k=split_k,
                                fuse_activations=False))
    wide = [n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)
            and "transformer_blocks" in n and m.in_features > split_k]
    assert wide and ("single_transformer_blocks.0.proj_out" in wide)
    eager = _run(model, inputs)
    _, ops, traced = _quantize_ops_traced(model, inputs)
    assert ops == ["omni_kernels.quantize_per_token_triton"] * len(wide)
    assert _rel(traced, eager) <= COMPILED_VS_EAGER
