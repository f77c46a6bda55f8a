"""Tests of the eager fast path of omni's quantized linears: eager calls on plain tensors run
the Triton launchers directly (no custom-op dispatch, no no-op reshape or cast), anything that
traces goes through the op, and both give the same bits.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omni_kernels._triton import triton_interpreter_enabled
from omni_kernels.quant import quantize_per_token, quantize_weight, scaled_mm, weight_only_mm
from omni_kernels.quant.reference import scaled_linear_reference, weight_only_linear_reference

from quant_linear_cases import _rel


class _RecordOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops dispatched inside the ``with`` block, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_fp8_gemm_dispatches_no_no_op_reshape_or_cast(inputs):
    """An eager 2-D W8A8 FP8 call on scales already float32 [M, 1] / [N] and a bias in the output
    dtype dispatches only the transpose, the scale's [1, N] view and the GEMM (every no-op
    reshape or cast is a dispatched call: host time an eager layer pays per call); a 2-D
    quantization returns the op's outputs as they are."""
    x = inputs.activations((8, 64), torch.bfloat16)
    w_q, w_scale = quantize_weight(inputs.activations((32, 64), torch.float32), "fp8")
    bias = inputs.activations((32,), torch.bfloat16, outlier_channels=0)
    x_q, x_scale = quantize_per_token(x, "fp8", backend="torch")
    assert x_scale.shape == (8, 1) and x_scale.dtype == torch.float32
    with torch.no_grad(), _RecordOps() as record:
        out = scaled_mm(x_q, x_scale, w_q, w_scale, bias, torch.bfloat16, backend="aten")
    assert record.ops == ["aten.t.default", "aten.view.default", "aten._scaled_mm.default"]
    torch.testing.assert_close(out, scaled_mm(x_q, x_scale.reshape(8), w_q, w_scale.reshape(32, 1), bias.float(),
                                              torch.bfloat16, backend="aten"), rtol=0, atol=0)
    with torch.no_grad(), _RecordOps() as record:
        quantize_per_token(x, "fp8", backend="torch")
    assert not {"aten.view.default", "aten._unsafe_view.default"} & set(record.ops[-3:]), record.ops


def test_eager_launch_allowed_only_for_plain_eager_tensors():
    """Eager calls of omni's Triton quantization/GEMV run their launcher directly; anything that
    traces (a dispatch mode such as make_fx's, fake tensors, torch.compile) goes through the op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from omni_kernels._triton import eager_launch_allowed

    x = torch.randn(4, 8)
    assert eager_launch_allowed(x, None, nn.Parameter(torch.randn(8), requires_grad=False))
    with _RecordOps():
        assert not eager_launch_allowed(x)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    assert not eager_launch_allowed(fake)
    compiled = torch.compile(lambda t: t + int(eager_launch_allowed(t)), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), x)  # False while torch.compile traces


@pytest.mark.skipif(not (triton_interpreter_enabled() or torch.cuda.is_available()),
                    reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")
def test_eager_direct_launch_equals_the_op(inputs):
    """The launcher called directly and the op give the same bits (per-token, GELU-folded with a
    prefix, the weight-only GEMV, and the Triton GEMM for W8A8 and weight-only layers)."""
    from omni_kernels.quant import quantize_activated_per_token

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    x = inputs.activations((9, 64), dtype, device)
    head = inputs.activations((9, 24), dtype, device)
    direct = quantize_per_token(x, "int8", backend="triton")
    with _RecordOps() as record:  # a dispatch mode: the op path
        via_op = quantize_per_token(x, "int8", backend="triton")
    assert "omni_kernels.quantize_per_token_triton.default" in record.ops
    assert all(torch.equal(a, b) for a, b in zip(direct, via_op, strict=True))
    direct = quantize_activated_per_token(x, "int8", activation="gelu_tanh", prefix=head, backend="triton")
    with _RecordOps() as record:
        via_op = quantize_activated_per_token(x, "int8", activation="gelu_tanh", prefix=head, backend="triton")
    assert "omni_kernels.quantize_activated_concat_triton.default" in record.ops
    assert all(torch.equal(a, b) for a, b in zip(direct, via_op, strict=True))
    w_q, w_scale = quantize_weight(inputs.activations((40, 64), torch.float32, device), "int8")
    direct = weight_only_mm(x[:3], w_q, w_scale, None, backend="triton_gemv")
    with _RecordOps() as record:
        via_op = weight_only_mm(x[:3], w_q, w_scale, None, backend="triton_gemv")
    assert "omni_kernels.weight_only_gemv_triton.default" in record.ops
    assert torch.equal(direct, via_op)
    x_q, x_scale = quantize_per_token(x, "int8")
    direct = scaled_mm(x_q, x_scale, w_q, w_scale, None, dtype, backend="triton")
    with _RecordOps() as record:
        via_op = scaled_mm(x_q, x_scale, w_q, w_scale, None, dtype, backend="triton")
    assert "omni_kernels.scaled_mm_triton.default" in record.ops
    assert torch.equal(direct, via_op)
    direct = weight_only_mm(x, w_q, w_scale, None, backend="triton")
    with _RecordOps() as record:
        via_op = weight_only_mm(x, w_q, w_scale, None, backend="triton")
    assert "omni_kernels.scaled_mm_triton.default" in record.ops
    assert torch.equal(direct, via_op)


@pytest.mark.skipif(not (triton_interpreter_enabled() or torch.cuda.is_available()),
                    reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")
def test_eager_triton_gemm_skips_the_op_dispatch(inputs, monkeypatch):
    """Eager W8A8 and weight-only Triton GEMMs on plain tensors call the launcher, not the op
    (whose dispatch is host time an eager layer pays per call)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = inputs.activations((9, 64), torch.float16, device)
    w_q, w_scale = quantize_weight(inputs.activations((40, 64), torch.float32, device), "int8")
    x_q, x_scale = quantize_per_token(x, "int8")

    def not_called(*args, **kwargs):
        raise AssertionError("the eager path went through omni_kernels::scaled_mm_triton")

    monkeypatch.setattr(torch.ops.omni_kernels, "scaled_mm_triton", not_called)
    out = scaled_mm(x_q, x_scale, w_q, w_scale, None, torch.float16, backend="triton")
    ref = scaled_linear_reference(x_q, x_scale, w_q, w_scale, None, torch.float32)
    assert _rel(out, ref) <= 1e-3
    out = weight_only_mm(x, w_q, w_scale, None, backend="triton")
    assert _rel(out, weight_only_linear_reference(x.float(), w_q, w_scale, None)) <= 1e-3


def test_eager_direct_launch_turns_wrap_triton_dispatch_off(monkeypatch):
    """Through wrap_triton's higher-order op an eager launch cost ~0.5 ms on the H200's host
    (a7b2ef0); the direct path must launch as the triton_op's own eager body does, with it off."""
    from torch._library.triton import is_wrap_triton_enabled

    import omni_kernels.quant.triton_kernel as triton_kernel

    seen = []

    def launcher(*args, **kwargs):
        seen.append(is_wrap_triton_enabled())
        x = args[0]
        return torch.zeros(x.shape, dtype=torch.int8), torch.ones(x.shape[0], 1)

    monkeypatch.setattr(triton_kernel, "launch_quantize_per_token_triton", launcher)
    monkeypatch.setattr("omni_kernels.quant.dispatch.triton_ineligible_reason", lambda x2, qdtype: None)
    assert is_wrap_triton_enabled()
    quantize_per_token(torch.randn(3, 16), "int8", backend="triton")
    assert seen == [False] and is_wrap_triton_enabled()
