"""Tests of :func:`quantize_per_token` as an API and an op: argument checks, the backends'
availability and ``"auto"``'s order, ``torch.library.opcheck`` and ``torch.compile``.

GPU part (``-m gpu``): opcheck of the CUDA op, and the Triton op under Inductor.
"""

from __future__ import annotations

import pytest
import torch

from omni_kernels import has_compiled_extension
from omni_kernels._triton import triton_interpreter_enabled
from omni_kernels.quant import FP8_DTYPE, dequantize, quantize_per_token, supported_backends

from quant_per_token_cases import (
    OPCHECK_UTILS,
    _require_cuda_extension,
    _require_fp8,
    needs_interpreter_or_gpu,
)


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
