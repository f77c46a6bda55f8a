"""Tests of the C++ CUDA ops of the quantized linears: the cuBLASLt FP8 GEMM
(``backend="cublaslt"``) and the one-op eager FP8 layer (``omni_kernels::quantized_linear_fp8``).

CPU part (CI): where the fused eager path is taken, the cuBLASLt backend's refusals, and
``"auto"`` choosing cuBLASLt on compute capability 9.0 only.

GPU part (``-m gpu``): the cuBLASLt GEMM against the float32 reference (empty and strided
operands, tuning under CUDA-graph capture), the fused op against the two-call path and under
``opcheck``, and bad arguments to the C++ ops.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omni_kernels.quant import (
    FP8_DTYPE,
    QuantizedLinear,
    fp8_gemm_plans,
    quantize_per_token,
    quantize_weight,
    scaled_mm,
    weight_only_mm,
)
from omni_kernels.quant.reference import scaled_linear_reference

from quant_linear_cases import FLUX_LINEAR_SHAPES, _rel, _skip_without_fp8


def test_fused_fp8_eager_path_needs_cuda_bf16_and_auto_backends(inputs):
    """The one-op eager FP8 path is taken only where the two-call path's auto choices are the
    same kernels: never for CPU tensors, other backends, or another input dtype."""
    from omni_kernels.quant.linear import fused_fp8_eager_gemm

    x = inputs.activations((8, 64), torch.bfloat16)
    w_q, w_scale = quantize_weight(inputs.activations((32, 64), torch.float32), "fp8")
    assert fused_fp8_eager_gemm(x, w_q, w_scale, None, "auto", "auto") is None  # CPU tensors
    for backend, activation_backend in (("triton", "auto"), ("torch", "auto"), ("auto", "triton"), ("auto", "torch")):
        assert fused_fp8_eager_gemm(x, w_q, w_scale, None, backend, activation_backend) is None


def test_cublaslt_backend_refusals_name_the_reason(inputs):
    """backend='cublaslt' is FP8 W8A8 on CUDA only; anything else is a ValueError that says why,
    and weight-only layers do not offer it."""
    x_q = inputs.activations((4, 32), torch.float32).to(FP8_DTYPE)
    w_q = inputs.activations((16, 32), torch.float32).to(FP8_DTYPE)
    s_x, s_w = torch.ones(4, 1), torch.ones(16)
    with pytest.raises(ValueError, match=r"backend='cublaslt' cannot take these inputs: .*runs on CUDA tensors"):
        scaled_mm(x_q, s_x, w_q, s_w, backend="cublaslt")
    with pytest.raises(ValueError, match=r"backend='cublaslt' cannot take these inputs: .*FP8 only"):
        scaled_mm(x_q.view(torch.int8), s_x, w_q.view(torch.int8), s_w, backend="cublaslt")
    with pytest.raises(ValueError, match=r"backend must be one of .* for method 'fp8_weight_only'"):
        QuantizedLinear(32, 16, method="fp8_weight_only", backend="cublaslt")
    with pytest.raises(ValueError, match=r"backend must be one of"):
        weight_only_mm(torch.ones(4, 32), w_q, s_w, backend="cublaslt")
    with pytest.raises(ValueError, match=r"backend must be one of .* for method 'int8'; got 'cublaslt'"):
        QuantizedLinear(32, 16, method="int8", backend="cublaslt")
    assert QuantizedLinear(32, 16, method="fp8", backend="cublaslt").backend == "cublaslt"
    if not torch.cuda.is_available():
        assert fp8_gemm_plans() == []  # no CUDA call has made a plan


def test_cublaslt_auto_only_on_the_measured_capability(monkeypatch):
    """'auto' takes the cuBLASLt GEMM on compute capability 9.0 only, in eager mode by the GPU's
    capability and while tracing by the capability an eager call cached (none: aten)."""
    from omni_kernels import _device
    from omni_kernels.quant import gemm_backends

    if not gemm_backends._HAS_CUBLASLT_OP:
        pytest.skip("the compiled extension has no fp8_gemm_cublaslt op")
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(_device, "_capabilities", {0: (8, 9)})
    assert "compute capability 9.0 only (measured there; this GPU: 8.9)" in gemm_backends._cublaslt_problem_reason(
        cuda0, 64, 64, torch.bfloat16, True)
    assert gemm_backends._cublaslt_problem_reason(cuda0, 64, 64, torch.bfloat16, False) is None  # asked for: allowed
    monkeypatch.setattr(_device, "_capabilities", {0: (9, 0)})
    assert gemm_backends._cublaslt_problem_reason(cuda0, 64, 64, torch.bfloat16, True) is None
    assert "multiples of 16" in gemm_backends._cublaslt_problem_reason(cuda0, 64, 40, torch.bfloat16, True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert gemm_backends._cublaslt_problem_reason(cuda0, 64, 64, torch.bfloat16, True) is None
    monkeypatch.setattr(_device, "_capabilities", {})
    assert "not known while tracing" in gemm_backends._cublaslt_problem_reason(cuda0, 64, 64, torch.bfloat16, True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    # A failure under "auto" (logged once) keeps "auto" on aten for that device from then on.
    monkeypatch.setattr(_device, "_capabilities", {0: (9, 0), 1: (9, 0)})
    monkeypatch.setattr(gemm_backends, "_cublaslt_failed_devices", set())
    gemm_backends._cublaslt_failed(cuda0, RuntimeError("fp8_gemm_cublaslt: cublasLtMatmul failed: ..."))
    assert "failed on this device earlier" in gemm_backends._cublaslt_problem_reason(cuda0, 64, 64, torch.bfloat16, True)
    assert gemm_backends._cublaslt_problem_reason(torch.device("cuda", 1), 64, 64, torch.bfloat16, True) is None


# ============================================================================ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("tune", [True, False], ids=["tuned", "heuristic"])
@pytest.mark.parametrize("fast_accum", [True, False], ids=["fast", "promoted"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("m,k,n", [pytest.param(333, 1040, 48, id="odd-M"), pytest.param(1, 256, 4096, id="M1"),
                                   pytest.param(4608, 12288, 3072, id="flux-12288x3072")])
def test_gpu_cublaslt_fp8_gemm_matches_reference(inputs, m, k, n, bias, out_dtype, fast_accum, tune):
    """omni's cuBLASLt FP8 GEMM (row-wise scales, bias epilogue) against the float32 reference on
    the same operands and against torch._scaled_mm."""
    _skip_without_fp8("fp8")
    torch.manual_seed(inputs.seed)
    x = inputs.activations((m, k), torch.bfloat16, "cuda")
    x_q, x_scale = quantize_per_token(x, "fp8", backend="torch")
    w_q, w_scale = quantize_weight(inputs.activations((n, k), torch.float32, "cuda"), "fp8")
    b = inputs.activations((n,), out_dtype, "cuda", outlier_channels=0) if bias else None
    expected = scaled_linear_reference(x_q, x_scale, w_q, w_scale, b, torch.float32)
    out = torch.ops.omni_kernels.fp8_gemm_cublaslt(x_q, x_scale, w_q, w_scale, b, out_dtype, fast_accum, tune)
    torch.cuda.synchronize()
    assert out.shape == (m, n) and out.dtype == out_dtype and torch.isfinite(out).all()
    limit = (3e-2 if k <= 4096 else 1.5e-1) if fast_accum else 1e-2
    err = _rel(out, expected)
    assert err <= limit, f"rel err {err:.3e} (limit {limit:.0e})"
    if out_dtype == torch.bfloat16:
        aten = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.view(1, n), bias=b,
                                out_dtype=out_dtype, use_fast_accum=fast_accum)
        assert _rel(out, aten) <= limit
    again = torch.ops.omni_kernels.fp8_gemm_cublaslt(x_q, x_scale, w_q, w_scale, b, out_dtype, fast_accum, tune)
    assert torch.equal(out, again)  # the plan, once chosen, is kept
    plans = [line for line in fp8_gemm_plans() if f" M={m} N={n} K={k} " in line]
    assert plans, fp8_gemm_plans()
    if tune:  # (an untuned call may find the plan an earlier test tuned: it keeps that)
        assert any("tuned: rank" in line for line in plans), plans
    print(*plans, sep="\n")


@pytest.mark.gpu
def test_gpu_cublaslt_no_rows_and_bad_sizes(inputs):
    """M = 0 gives an empty [0, N] result (cuBLASLt itself refuses empty problems); K = 0 is an
    error naming the sizes."""
    _skip_without_fp8("fp8")
    w_q, w_scale = quantize_weight(inputs.activations((32, 64), torch.float32, "cuda"), "fp8")
    empty = torch.empty(0, 64, device="cuda").to(FP8_DTYPE)
    out = torch.ops.omni_kernels.fp8_gemm_cublaslt(empty, torch.empty(0, device="cuda"), w_q, w_scale, None,
                                                   torch.bfloat16, False, True)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match=r"K and N must be positive multiples of 16; got K=0, N=32"):
        torch.ops.omni_kernels.fp8_gemm_cublaslt(empty.view(64, 0), torch.ones(64, device="cuda"), w_q[:, :0],
                                                 w_scale, None, torch.bfloat16, False, True)


@pytest.mark.gpu
def test_gpu_cublaslt_takes_strided_and_offset_operands(inputs):
    """Views that are not contiguous or not 16-byte aligned (a traced graph may pass them) give
    the result of their contiguous copies."""
    _skip_without_fp8("fp8")
    m, k, n = 72, 512, 96
    x_q, x_scale = quantize_per_token(inputs.activations((m + 1, 2 * k), torch.bfloat16, "cuda"), "fp8",
                                      backend="torch")
    w_q, w_scale = quantize_weight(inputs.activations((n, k), torch.float32, "cuda"), "fp8")
    strided = x_q[1:, ::2]  # every other column: not contiguous
    offset = x_q.view(-1)[1:1 + m * k].view(m, k)  # contiguous, 1 byte past a 16-byte boundary
    aligned16 = x_q.view(-1)[16:16 + m * k].view(m, k)  # 16-byte aligned, not 256: its own plan
    scale = x_scale[1:]
    for a in (strided, offset, aligned16):
        out = torch.ops.omni_kernels.fp8_gemm_cublaslt(a, scale, w_q, w_scale, None, torch.bfloat16, False, True)
        dense = torch.ops.omni_kernels.fp8_gemm_cublaslt(a.contiguous(), scale.contiguous(), w_q, w_scale, None,
                                                         torch.bfloat16, False, True)
        assert torch.equal(out, dense)
        expected = scaled_linear_reference(a.contiguous(), scale, w_q, w_scale, None, torch.float32)
        assert _rel(out, expected) <= 1e-2


@pytest.mark.gpu
def test_gpu_cublaslt_tuning_waits_outside_cuda_graph_capture(inputs):
    """A tuned plan's first call inside CUDA-graph capture runs the heuristic's choice untimed
    (timing would synchronize the capturing stream); the replay is right, and the first call
    outside the capture tunes the plan."""
    _skip_without_fp8("fp8")
    m, k, n = 136, 512, 272
    x_q, x_scale = quantize_per_token(inputs.activations((m, k), torch.bfloat16, "cuda"), "fp8", backend="torch")
    w_q, w_scale = quantize_weight(inputs.activations((n, k), torch.float32, "cuda"), "fp8")
    expected = scaled_linear_reference(x_q, x_scale, w_q, w_scale, None, torch.float32)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = torch.ops.omni_kernels.fp8_gemm_cublaslt(x_q, x_scale, w_q, w_scale, None, torch.bfloat16, False, True)
    line = [p for p in fp8_gemm_plans() if f" M={m} N={n} K={k} " in p]
    assert line and "heuristic's first" in line[0], line
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, expected) <= 1e-2
    torch.ops.omni_kernels.fp8_gemm_cublaslt(x_q, x_scale, w_q, w_scale, None, torch.bfloat16, False, True)
    line = [p for p in fp8_gemm_plans() if f" M={m} N={n} K={k} " in p]
    assert line and "tuned: rank" in line[0], fp8_gemm_plans()


@pytest.mark.gpu
@pytest.mark.parametrize("clamp", [None, 6.0], ids=["no-clamp", "clamp"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("backend", ["auto", "aten", "cublaslt"])
@pytest.mark.parametrize("m,k,n", [*FLUX_LINEAR_SHAPES, pytest.param(333, 1040, 48, id="odd-M")])
def test_gpu_fused_fp8_eager_op_equals_the_two_call_path(inputs, monkeypatch, m, k, n, bias, clamp, backend):
    """An eager FP8 layer runs as the one op omni_kernels::quantized_linear_fp8, bit-identical to
    the quantization op followed by the backend's GEMM (the same kernels from C++)."""
    _skip_without_fp8("fp8")
    from omni_kernels.quant import linear as quant_linear

    torch.manual_seed(inputs.seed)
    layer = QuantizedLinear.from_linear(nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16), "fp8",
                                        clamp=clamp, backend=backend)
    x = inputs.activations((m, k), torch.bfloat16, "cuda")
    calls = []
    fused_op = torch.ops.omni_kernels.quantized_linear_fp8

    class _CountingOps:  # torch.ops.omni_kernels with the fused op's calls counted
        def __getattr__(self, name):
            if name == "quantized_linear_fp8":
                return lambda *args: calls.append(name) or fused_op(*args)
            return getattr(torch.ops.omni_kernels, name)

    with torch.no_grad():
        with monkeypatch.context() as patch:
            patch.setattr(quant_linear.torch.ops, "omni_kernels", _CountingOps(), raising=False)
            fused = layer(x)
        assert calls == ["quantized_linear_fp8"]
        with monkeypatch.context() as patch:
            patch.setattr(quant_linear, "fused_fp8_eager_gemm", lambda *args: None)
            two_calls = layer(x)
        torch.cuda.synchronize()
    assert torch.equal(fused, two_calls)
    assert fused_fp8_eager_gemm_for(layer, x) == {"aten": "aten", "cublaslt": "cublaslt_tuned"}.get(
        backend, "cublaslt_tuned" if torch.cuda.get_device_capability() == (9, 0) else "aten")
    assert fused_fp8_eager_gemm_for(layer, x.half()) is None  # the one op takes bfloat16 only


def fused_fp8_eager_gemm_for(layer, x):
    from omni_kernels.quant.linear import fused_fp8_eager_gemm

    return fused_fp8_eager_gemm(x, layer.qweight, layer.weight_scale, layer.bias, layer.backend,
                                layer.activation_backend)


@pytest.mark.gpu
def test_gpu_fused_fp8_op_opcheck(inputs):
    """torch.library.opcheck on the fused op (fake implementation, autograd registration, AOT
    dispatch); its schema's promise (no input mutated, the output a new tensor) checked by hand,
    since opcheck's schema test compares tensors with arithmetic CUDA has no float8 kernel for."""
    _skip_without_fp8("fp8")
    x = inputs.activations((40, 256), torch.bfloat16, "cuda")
    w_q, w_scale = quantize_weight(inputs.activations((64, 256), torch.float32, "cuda"), "fp8")
    bias = inputs.activations((64,), torch.bfloat16, "cuda", outlier_channels=0)
    for gemm in ("aten", "cublaslt", "cublaslt_tuned"):
        args = (x, w_q, w_scale, bias, 0.0, True, gemm)
        torch.library.opcheck(torch.ops.omni_kernels.quantized_linear_fp8.default, args,
                              test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
        before = [t.clone() for t in (x, w_q.view(torch.uint8), w_scale, bias)]
        out = torch.ops.omni_kernels.quantized_linear_fp8(*args)
        after = (x, w_q.view(torch.uint8), w_scale, bias)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert out.shape == (40, 64) and out.dtype == torch.bfloat16
        assert all(out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in after)
    x_q, x_scale = quantize_per_token(x, "fp8", backend="torch")
    torch.library.opcheck(torch.ops.omni_kernels.fp8_gemm_cublaslt.default,
                          (x_q, x_scale, w_q, w_scale, bias, torch.bfloat16, False, True),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


_BAD_CALL_SCRIPT = """
import torch, omni_kernels.quant.gemm_ops
from omni_kernels.quant import quantize_weight
x = torch.randn(40, 256, device="cuda", dtype=torch.bfloat16)
w_q, w_scale = quantize_weight(torch.randn(64, 256, device="cuda"), "fp8")
bias = torch.randn(64, device="cuda", dtype=torch.bfloat16)
ops = torch.ops.omni_kernels
try:
    {call}
except RuntimeError as error:
    # flushed at once: a crash at interpreter exit must not hide that the call raised
    print(str(error).splitlines()[0], flush=True)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("call,message", [
    ("ops.quantized_linear_fp8(x, w_q, w_scale, bias.float(), 0.0, True, 'aten')",
     "quantized_linear_fp8: bias must be [N=64] in x's dtype BFloat16; got Float with 64 values"),
    ("ops.quantized_linear_fp8(x[:, :128], w_q, w_scale, None, 0.0, True, 'aten')",
     "quantized_linear_fp8: x must be [M, K=256]; got a 2-D tensor with 128 columns"),
    ("ops.quantized_linear_fp8(x, w_q, w_scale.double(), None, 0.0, True, 'cublaslt')",
     "quantized_linear_fp8: w_scale must be a contiguous float32 [N=64]; got Double with 64 values"),
    ("ops.quantized_linear_fp8(x, w_q, w_scale, None, 0.0, True, 'cutlass')",
     "quantized_linear_fp8: gemm must be 'aten', 'cublaslt' or 'cublaslt_tuned'; got 'cutlass'"),
    ("ops.fp8_gemm_cublaslt(w_q[:40], torch.ones(39, device='cuda'), w_q, w_scale, None, torch.bfloat16, False, True)",
     "fp8_gemm_cublaslt: a_scale must be a Float with 40 values; got Float [39]"),
    ("ops.fp8_gemm_cublaslt(w_q[:40, :200], w_scale[:40], w_q[:, :200], w_scale, None, torch.bfloat16, False, True)",
     "fp8_gemm_cublaslt: K and N must be positive multiples of 16; got K=200, N=64"),
    ("ops.fp8_gemm_cublaslt(w_q[:40], w_scale[:40], w_q, w_scale, None, torch.float32, False, True)",
     "fp8_gemm_cublaslt: out_dtype must be bfloat16 or float16; got Float"),
    # The message streams x.sizes(): on the H200 machine (torch 2.11) the fused op's first checks,
    # which streamed sizes too, crashed (SIGSEGV) instead of raising; this says whether it is that.
    ("ops.quantize_per_token(x.reshape(2, 20, 256), None, None, None, None, 0, 0.0, 0.0, torch.float8_e4m3fn)",
     "quantize_per_token: x must be 2-D [M, K]; got [2, 20, 256]"),
], ids=["bias-dtype", "x-width", "w-scale-dtype", "gemm-name", "lt-scale-count", "lt-k-align", "lt-out-dtype",
        "quantize-3d"])
def test_gpu_cuda_op_bad_arguments_raise(call, message):
    """Bad arguments to the C++ ops raise RuntimeError naming the argument. Each call runs in
    its own interpreter: a crash is this test's failure, not the end of the test run."""
    _skip_without_fp8("fp8")
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _BAD_CALL_SCRIPT.format(call=call)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert result.stdout.strip() == message
