"""Tests of :class:`omni_kernels.quant.QuantizedLinear` (CPU, CI): against the float32
``nn.Linear`` for every method, state_dict and dtype handling, pre-quantized input, option
checks, zero rows, and ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import pytest
import torch

from omni_kernels.quant import FP8_DTYPE, QUANT_METHODS, QuantizedLinear, quantize_per_token
from omni_kernels.quant.reference import scaled_linear_reference, weight_only_linear_reference

from quant_linear_cases import MODULE_TOLERANCE, _Block, _linear, _rel, needs_interpreter


@pytest.mark.parametrize("method", QUANT_METHODS)
def test_module_matches_linear(inputs, method):
    linear = _linear(inputs, 64, 48)
    layer = QuantizedLinear.from_linear(linear, method, backend="aten", activation_backend="torch")
    x = inputs.activations((2, 7, 64), torch.float32)
    with torch.no_grad():
        out, ref = layer(x), linear(x)
    assert out.shape == ref.shape and out.dtype == x.dtype
    err = _rel(out, ref)
    assert err <= MODULE_TOLERANCE[method], f"{method}: relative error {err:.3e}"
    # The layer's output is exactly the reference GEMM on its own quantized operands.
    w_q, w_scale = layer.qweight, layer.weight_scale
    if method.endswith("_weight_only"):
        expected = weight_only_linear_reference(x.reshape(-1, 64), w_q, w_scale, layer.bias)
    else:
        x_q, x_scale = quantize_per_token(x.reshape(-1, 64), w_q.dtype, backend="torch")
        expected = scaled_linear_reference(x_q, x_scale, w_q, w_scale, layer.bias, torch.float32)
    assert _rel(out.reshape(-1, 48), expected) <= 1e-6


def test_module_state_and_dtype_handling(inputs):
    linear = _linear(inputs, 32, 16)
    layer = QuantizedLinear.from_linear(linear, "fp8")
    assert set(layer.state_dict()) == {"qweight", "weight_scale", "bias"}
    assert [name for name, _ in layer.named_parameters()] == ["bias"]
    assert not layer.bias.requires_grad
    assert layer.qweight.dtype == FP8_DTYPE and layer.weight_scale.dtype == torch.float32
    scales = layer.weight_scale.clone()
    layer.to(torch.bfloat16)  # converts the bias only
    assert layer.qweight.dtype == FP8_DTYPE and layer.weight_scale.dtype == torch.float32
    assert torch.equal(layer.weight_scale, scales)
    assert layer.bias.dtype == torch.bfloat16
    layer.half()
    assert layer.qweight.dtype == FP8_DTYPE and layer.bias.dtype == torch.float16
    # dequantized_weight is the per-channel dequantization of the linear's weight.
    w = linear.weight.detach()
    assert _rel(layer.dequantized_weight(), w) <= 0.05
    no_bias = QuantizedLinear.from_linear(_linear(inputs, 32, 16, bias=False), "int8")
    assert no_bias.bias is None and set(no_bias.state_dict()) == {"qweight", "weight_scale"}
    assert "method='fp8'" in repr(layer)


def test_module_forward_quantized_equals_forward(inputs):
    """An input quantized outside (e.g. by the adaLN-fused kernel) gives the layer's own result."""
    layer = QuantizedLinear.from_linear(_linear(inputs, 64, 32), "int8", backend="aten",
                                        activation_backend="torch")
    x = inputs.activations((3, 5, 64), torch.float32)
    x_q, x_scale = quantize_per_token(x, "int8", backend="torch")
    assert torch.equal(layer.forward_quantized(x_q, x_scale, torch.float32), layer(x))
    with pytest.raises(ValueError, match=r"x_q must be torch.int8"):
        layer.forward_quantized(x_q.to(FP8_DTYPE), x_scale, torch.float32)
    weight_only = QuantizedLinear.from_linear(_linear(inputs, 64, 32), "int8_weight_only")
    with pytest.raises(ValueError, match=r"needs a W8A8 method"):
        weight_only.forward_quantized(x_q, x_scale, torch.float32)


def test_module_rejects_bad_options():
    with pytest.raises(ValueError, match=r"method must be one of"):
        QuantizedLinear(16, 16, method="int4")
    with pytest.raises(ValueError, match=r"backend must be one of"):
        QuantizedLinear(16, 16, backend="cutlass")
    with pytest.raises(ValueError, match=r"activation_backend must be one of"):
        QuantizedLinear(16, 16, activation_backend="aten")


def test_module_dequantized_fallback_on_zero_rows(inputs):
    """A zero input row (padding tokens) gives exactly the bias."""
    layer = QuantizedLinear.from_linear(_linear(inputs, 32, 16), "fp8", backend="aten",
                                        activation_backend="torch")
    out = layer(torch.zeros(2, 32))
    assert torch.equal(out, layer.bias.detach().expand(2, 16))


@pytest.mark.parametrize(
    "method,backend,activation_backend",
    [
        ("fp8", "aten", "torch"),
        ("int8", "aten", "torch"),
        ("fp8_weight_only", "aten", "torch"),
        ("int8_weight_only", "torch", "torch"),
        ("fp8", "auto", "auto"),
        ("int8_weight_only", "auto", "auto"),
        pytest.param("int8", "triton", "triton", marks=needs_interpreter),
        pytest.param("int8_weight_only", "triton", "torch", marks=needs_interpreter),
    ],
)
@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(inputs, compile_backend, method, backend, activation_backend):
    torch.manual_seed(inputs.seed)
    block = _Block().eval()
    for name in ("up", "down"):
        setattr(block, name, QuantizedLinear.from_linear(
            getattr(block, name), method, backend=backend, activation_backend=activation_backend))
    x = inputs.activations((2, 5, 32), torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=compile_backend, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), block(x), rtol=1e-6, atol=1e-6)
