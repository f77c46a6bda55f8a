"""Tests of :meth:`QuantizedLinear.forward_concat`: ``self(cat(head, GELU-activated tail))``
with the cat never written where the layer's GELU starts right after the head.

CPU part (CI): the prefix path against the cat, the layers that concatenate instead,
mismatched inputs, an empty head, and ``torch.compile(fullgraph=True)``.

GPU part (``-m gpu``): Flux's single-block ``proj_out``, eager and under Inductor.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omni_kernels.quant import QuantizedLinear

from quant_linear_cases import (
    GPU_LAYER_TOLERANCE,
    MODULE_TOLERANCE,
    _dynamo_graphs,
    _linear,
    _omni_quantize_ops,
    _rel,
    _skip_without_fp8,
    needs_interpreter,
)


def _head_tail(inputs, lead, k0, k, dtype=torch.float32, device="cpu"):
    """``head`` ``[*lead, k0]`` a column slice of a wider tensor (rows strided past their width,
    as a view of an attention output would be) and ``tail`` ``[*lead, k]``."""
    head = inputs.activations((*lead, k0 + 16), dtype, device)[..., 8:8 + k0]
    return head, inputs.activations((*lead, k), dtype, device)


def _record_prefixes(monkeypatch) -> list[bool]:
    """Spy on the layer's activated quantization: one entry per call, True if given a prefix."""
    import omni_kernels.quant.linear as linear_module

    calls = []
    original = linear_module.quantize_activated_per_token

    def spy(*args, **kwargs):
        calls.append(kwargs.get("prefix") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(linear_module, "quantize_activated_per_token", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("method,activation_backend", [
    ("fp8", "torch"), ("int8", "torch"), pytest.param("int8", "triton", marks=needs_interpreter),
])
def test_forward_concat_reads_head_and_tail_in_place(inputs, monkeypatch, method, activation_backend, dtype):
    """A W8A8 layer whose GELU starts right after the head quantizes head and tail in place
    (the prefix path) and returns exactly self(cat(head, tail)), at odd widths (24 + 40), the head
    a strided view."""
    k0, k = 24, 40
    linear = _linear(inputs, k0 + k, 48).to(dtype)
    layer = QuantizedLinear.from_linear(linear, method, activation_backend=activation_backend,
                                        input_activation="gelu_tanh", activation_from=k0)
    head, tail = _head_tail(inputs, (3, 5), k0, k, dtype)
    calls = _record_prefixes(monkeypatch)
    with torch.no_grad():
        out = layer.forward_concat(head, tail)
        expected = layer(torch.cat([head, tail], -1))
    assert calls == [True, False]
    assert out.shape == (3, 5, 48) and out.dtype == dtype and torch.equal(out, expected)
    activated = torch.cat([head, torch.nn.functional.gelu(tail, approximate="tanh")], -1)
    assert _rel(out, linear(activated)) <= MODULE_TOLERANCE[method] + (0.01 if dtype == torch.float16 else 0)


@pytest.mark.parametrize("method,options", [
    pytest.param("int8", {}, id="w8a8-no-activation"),
    pytest.param("fp8", dict(input_activation="gelu_tanh", activation_from=10), id="activation-from-10"),
    pytest.param("int8", dict(input_activation="gelu_tanh", activation_from=0), id="activation-from-0"),
    pytest.param("fp8_weight_only", {}, id="fp8-weight-only"),
    pytest.param("int8_weight_only", {}, id="int8-weight-only"),
])
def test_forward_concat_other_layers_concatenate(inputs, monkeypatch, method, options):
    """Every other layer concatenates and runs forward's path: the same output, no prefix passed."""
    k0, k = 24, 40
    layer = QuantizedLinear.from_linear(_linear(inputs, k0 + k, 48), method, activation_backend="torch", **options)
    head, tail = _head_tail(inputs, (7,), k0, k)
    calls = _record_prefixes(monkeypatch)
    with torch.no_grad():
        assert torch.equal(layer.forward_concat(head, tail), layer(torch.cat([head, tail], -1)))
    assert not any(calls)


def test_forward_concat_rejects_mismatched_inputs(inputs):
    layer = QuantizedLinear.from_linear(_linear(inputs, 64, 16), "int8", activation_backend="torch",
                                        input_activation="gelu_tanh", activation_from=24)
    tail = torch.randn(5, 40)
    with pytest.raises(ValueError, match=r"prefix \[\.\.\., K0\] must have x's leading shape \(5,\); got \(4, 24\)"):
        layer.forward_concat(torch.randn(4, 24), tail)
    with pytest.raises(ValueError, match=r"prefix must have x's dtype torch.float32; got torch.float16"):
        layer.forward_concat(torch.randn(5, 24, dtype=torch.float16), tail)
    with pytest.raises(ValueError, match=r"must agree in K"):
        layer.forward_concat(torch.randn(5, 24), torch.randn(5, 30))
    plain = QuantizedLinear.from_linear(_linear(inputs, 64, 16), "int8", activation_backend="torch")
    with pytest.raises(ValueError, match=r"prefix must have x's dtype"):
        plain.forward_concat(torch.randn(5, 24, dtype=torch.float16), tail)


def test_forward_concat_empty_head(inputs):
    """A layer activated from column 0 on an empty head: the prefix path with K0 = 0 is forward(tail)."""
    layer = QuantizedLinear.from_linear(_linear(inputs, 40, 16), "int8", activation_backend="torch",
                                        input_activation="gelu_tanh", activation_from=0)
    tail = inputs.activations((2, 3, 40), torch.float32)
    with torch.no_grad():
        assert torch.equal(layer.forward_concat(tail[..., :0], tail), layer(tail))


class _ConcatProjection(nn.Module):
    """Flux's single block's output side: proj_out on cat(attention output, GELU(proj_mlp(h)))."""

    def __init__(self, layer):
        super().__init__()
        self.proj_out = layer

    def forward(self, attention, mlp):
        return self.proj_out.forward_concat(attention, mlp)


@pytest.mark.parametrize("activation_backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_forward_concat_compiles_fullgraph(inputs, compile_backend, activation_backend):
    """torch.compile(fullgraph=True) traces forward_concat; with the kernel backend the graph holds
    the concat op and no cat; the compiled output is the eager layer's on the cat, exactly."""
    k0, k = 24, 40
    layer = QuantizedLinear.from_linear(_linear(inputs, k0 + k, 32), "int8", activation_backend=activation_backend,
                                        input_activation="gelu_tanh", activation_from=k0)
    head, tail = _head_tail(inputs, (2, 5), k0, k)
    module = _ConcatProjection(layer)
    if activation_backend == "triton":
        graphs, _ = _dynamo_graphs(module, head, tail)
        cats = [node for node in graphs[0].graph.nodes
                if node.target in (torch.cat, torch.concat, torch.concatenate, torch.ops.aten.cat.default)]
        assert _omni_quantize_ops(graphs[0]) == ["omni_kernels.quantize_activated_concat_triton"]
        assert cats == []
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(module, backend=compile_backend, fullgraph=True)(head, tail)
        expected = layer(torch.cat([head, tail], -1))
    torch._dynamo.reset()
    assert torch.equal(compiled, expected)


# ============================================================================ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_gpu_forward_concat_at_flux_single_block(inputs, method):
    """Flux's single-block proj_out (4608 tokens, 3072 + 12288 -> 3072, bf16): forward_concat is
    forward on the cat, eager and under Inductor, and within the layer tolerance of the float32
    linear on cat(attention, GELU(mlp))."""
    _skip_without_fp8(method)
    k0, k, n = 3072, 12288, 3072
    torch.manual_seed(inputs.seed)
    linear = nn.Linear(k0 + k, n, device="cuda", dtype=torch.bfloat16)
    layer = QuantizedLinear.from_linear(linear, method, input_activation="gelu_tanh", activation_from=k0)
    head, tail = _head_tail(inputs, (1, 4608), k0, k, torch.bfloat16, "cuda")
    with torch.no_grad():
        out = layer.forward_concat(head, tail)
        expected = layer(torch.cat([head, tail], -1))
        torch._dynamo.reset()
        compiled = torch.compile(_ConcatProjection(layer), fullgraph=True)(head, tail)
        torch._dynamo.reset()
        activated = torch.cat([head.float(), torch.nn.functional.gelu(tail.float(), approximate="tanh")], -1)
        exact = activated @ linear.weight.float().t() + linear.bias.float()
    assert torch.equal(out, expected) and torch.equal(compiled, expected)
    err = _rel(out, exact)
    print(f"forward_concat {method} 4608x({k0}+{k})->{n}: rel err vs fp32 linear {err:.3e}")
    # One scale per 15360-wide row whose outlier channels sit in the head: INT8 loses more of
    # the GELU columns than on a plain layer input (H200: 1.009e-01 on these inputs).
    assert err <= {"fp8": GPU_LAYER_TOLERANCE["fp8"], "int8": 0.12}[method]
