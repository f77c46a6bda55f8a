"""Tests of the weight-only Triton GEMV (:mod:`omni_kernels.quant.triton_gemv`) and its wiring.

CPU part (CI, ``TRITON_INTERPRET=1``; float16/float32 activations, INT8 and FP8 weights):
the GEMV against a float64 product of the dequantized weight at small odd sizes (both
inner-product paths, split-K, every tuning knob including ``x_tile_load``, strided inputs), outputs written into a
NaN-poisoned buffer (every element written, nothing outside), bias in ``x``'s dtype, in
float32 or none; argument checks; ``torch.library.opcheck`` and ``torch.compile(fullgraph=True)``
of the op; :func:`~omni_kernels.quant.weight_only_mm`'s ``"triton_gemv"`` backend, its
errors, and the ``"auto"`` order (GEMV first on CUDA for ``M <= 16``, logged).

GPU part (``-m gpu``): bfloat16 at Flux's adaLN modulation shapes (3072 -> 18432 and
3072 -> 9216, one or two rows), the ``"auto"`` choice on a GPU, a split-K shape (its
result does not change between runs), and Inductor launching the ``triton_op``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from omni_kernels._triton import triton_interpreter_enabled
from omni_kernels.quant import WEIGHT_ONLY_BACKENDS, QuantizedLinear, quantize_weight, scaled_mm, weight_only_mm
from omni_kernels.quant import gemm_backends

# The CPU tests run the kernels in Triton's interpreter.
needs_interpreter = pytest.mark.skipif(not triton_interpreter_enabled(), reason="needs TRITON_INTERPRET=1")

X_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]
# Relative L2 error against the float64 product of the same operands: float32 output keeps
# ~1e-7 (float32 accumulation over K <= 200); float16 output is rounded once (2**-11 relative
# at most, ~2e-4 seen).
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _operands(inputs, m, k, n, qdtype, x_dtype, bias_dtype="x", device="cpu"):
    """``x`` with outlier channels; a weight with a few outlier output channels (their own
    per-channel scales); ``bias`` in ``x``'s dtype (``"x"``), float32, or ``None``."""
    x = inputs.activations((m, k), torch.float32, device).to(x_dtype)
    w = 0.05 * inputs.activations((n, k), torch.float32, device, outlier_channels=0)
    rows = torch.randperm(n, generator=inputs.generator(device), device=device)[:3]
    w[rows] *= 40.0
    w_q, w_scale = quantize_weight(w, qdtype)
    if bias_dtype is None:
        bias = None
    else:
        bias = inputs.activations((n,), torch.float32, device, outlier_channels=0)
        bias = bias.to(x_dtype if bias_dtype == "x" else bias_dtype)
    return x, w_q, w_scale, bias


def _reference(x, w_q, w_scale, bias):
    """float64 ``x @ (w_q * w_scale)^T + bias``: the exact result before any rounding."""
    out = x.double() @ (w_q.double() * w_scale.double()[:, None]).t()
    return out + bias.double() if bias is not None else out


def _gemv(*args, **knobs):
    from omni_kernels.quant.triton_gemv import launch_weight_only_gemv

    return launch_weight_only_gemv(*args, **knobs)


def _poisoned_out(m, n, dtype, device="cpu"):
    """An ``[m, n]`` view into a NaN-filled buffer with a border on every side."""
    buffer = torch.full((m + 2, n + 3), float("nan"), dtype=dtype, device=device)
    return buffer, buffer[1 : m + 1, 2 : n + 2]


def _check_border(buffer, m, n):
    inside = torch.zeros_like(buffer, dtype=torch.bool)
    inside[1 : m + 1, 2 : n + 2] = True
    assert torch.isnan(buffer[~inside]).all(), "the GEMV wrote outside its output"


# ============================================================================ CPU: the kernel


@needs_interpreter
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
@pytest.mark.parametrize("k,n", [(40, 24), (200, 100), (40, 100), (200, 24)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
def test_gemv_matches_float64_reference(inputs, m, k, n, qdtype, x_dtype):
    """Default knobs: the CUDA-core path for M <= 4, tl.dot above; K not a multiple of BLOCK_K."""
    x, w_q, w_scale, bias = _operands(inputs, m, k, n, qdtype, x_dtype)
    buffer, out = _poisoned_out(m, n, x_dtype)
    result = _gemv(x, w_q, w_scale, bias, out=out)
    assert result.data_ptr() == out.data_ptr() and result.dtype == x_dtype
    _check_border(buffer, m, n)
    assert torch.isfinite(out).all(), "an output element was not written"
    err = _rel(out, _reference(x, w_q, w_scale, bias))
    assert err <= TOLERANCE[x_dtype], f"relative error {err:.3e}"


@needs_interpreter
@pytest.mark.parametrize("bias_dtype", [None, torch.float32], ids=["nobias", "fp32bias"])
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gemv_bias_none_or_float32(inputs, m, x_dtype, bias_dtype):
    x, w_q, w_scale, bias = _operands(inputs, m, 200, 100, "int8", x_dtype, bias_dtype)
    out = _gemv(x, w_q, w_scale, bias)
    assert out.shape == (m, 100) and out.dtype == x_dtype
    assert _rel(out, _reference(x, w_q, w_scale, bias)) <= TOLERANCE[x_dtype]


# Knob sets: both paths, split-K (even and uneven K ranges, more splits asked than K chunks),
# small tiles and warps, K a multiple of BLOCK_K (no column masks).
KNOBS = [
    pytest.param(2, 200, dict(split_k=3, block_k=32), id="fma-split3"),
    pytest.param(1, 200, dict(split_k=16, block_k=16, block_n=16), id="fma-split-more-than-chunks"),
    pytest.param(3, 200, dict(block_n=16, block_k=16, num_warps=1), id="fma-small-tiles"),
    pytest.param(4, 200, dict(use_dot=True, split_k=2, block_k=64), id="dot-for-4-rows-split2"),
    pytest.param(16, 200, dict(block_n=32, block_k=32, num_warps=2, split_k=4), id="dot-split4"),
    pytest.param(2, 160, dict(block_k=16, block_n=128, num_stages=2), id="fma-even-k"),
    pytest.param(16, 192, dict(block_k=64, split_k=3), id="dot-even-k-split3"),
]


def _poison_new_buffers(monkeypatch):
    """From here on (until ``monkeypatch.undo()``), new floating-point ``torch.empty`` tensors
    (the split-K partial sums) start as NaN: a partial sum left unwritten shows."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)


@needs_interpreter
@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
@pytest.mark.parametrize("m,k,knobs", KNOBS)
def test_gemv_tuning_knobs_and_split_k(inputs, monkeypatch, m, k, knobs, qdtype):
    """Every knob gives the reference's result; split-K partial sums are written in full
    (new buffers are NaN-poisoned here) and added in a fixed order (two runs: same bits)."""
    x, w_q, w_scale, bias = _operands(inputs, m, k, 100, qdtype, torch.float32)
    _poison_new_buffers(monkeypatch)
    out = _gemv(x, w_q, w_scale, bias, **knobs)
    again = _gemv(x, w_q, w_scale, bias, **knobs)
    monkeypatch.undo()
    assert torch.isfinite(out).all()
    assert _rel(out, _reference(x, w_q, w_scale, bias)) <= TOLERANCE[torch.float32]
    assert torch.equal(out, again)


# x_tile_load shapes: K and N odd with the default tiles (K < BLOCK_K: column masks), and K a
# multiple of BLOCK_K (no masks; N odd).
X_TILE_SHAPES = [
    pytest.param(199, 101, {}, id="odd-k"),
    pytest.param(160, 37, dict(block_n=16, block_k=32), id="even-k"),
]


@needs_interpreter
@pytest.mark.parametrize("bias_dtype", ["x", None], ids=["bias", "nobias"])
@pytest.mark.parametrize("k,n,knobs", X_TILE_SHAPES)
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_x_tile_load(inputs, monkeypatch, m, qdtype, x_dtype, k, n, knobs, bias_dtype):
    """``x_tile_load=True`` (x read in the weight tile's layout; CUDA-core path) against float64,
    K unsplit and split in 3, into a NaN-poisoned output (and NaN-poisoned partial sums). ``x``
    is a view of a buffer with NaN columns past K: a column read without its mask makes NaNs.
    The interpreter computes the same products in the same order either way: same bits as the
    default load."""
    x, w_q, w_scale, bias = _operands(inputs, m, k, n, qdtype, x_dtype, bias_dtype)
    reference = _reference(x, w_q, w_scale, bias)
    x_buffer = torch.full((m, k + 16), float("nan"), dtype=x_dtype)
    x_buffer[:, :k] = x
    x = x_buffer[:, :k]
    _poison_new_buffers(monkeypatch)
    for split_k in (1, 3):
        buffer, out = _poisoned_out(m, n, x_dtype)
        _gemv(x, w_q, w_scale, bias, x_tile_load=True, split_k=split_k, out=out, **knobs)
        _check_border(buffer, m, n)
        assert torch.isfinite(out).all(), f"split_k={split_k}: an output element was not written"
        err = _rel(out, reference)
        assert err <= TOLERANCE[x_dtype], f"split_k={split_k}: relative error {err:.3e}"
        assert torch.equal(out, _gemv(x, w_q, w_scale, bias, split_k=split_k, **knobs))


def test_default_split_k_rule():
    """No split from N = 4096 on or when the column blocks fill the (assumed 132) SMs;
    otherwise enough programs to fill them, at most 16 and one per BLOCK_K chunk."""
    pytest.importorskip("triton")
    from omni_kernels.quant.triton_gemv import GEMV_MAX_M, default_split_k

    assert gemm_backends.GEMV_MAX_M == GEMV_MAX_M == 16  # gemm_backends.py keeps its own copy (no triton import)

    cpu = torch.device("cpu")
    assert default_split_k(18432, 3072, 32, 256, cpu) == 1
    assert default_split_k(4096, 3072, 32, 256, cpu) == 1
    assert default_split_k(3072, 3072, 16, 256, cpu) == 1  # 192 column blocks >= 132 SMs
    assert default_split_k(3072, 3072, 32, 256, cpu) == 2  # 96 blocks: 2 splits fill 132
    assert default_split_k(256, 3072, 32, 256, cpu) == 12  # 8 blocks: K has 12 chunks
    assert default_split_k(256, 65536, 32, 256, cpu) == 16


@needs_interpreter
def test_gemv_strided_inputs(inputs):
    """A column slice of a wider activation and a row slice of a taller weight are read in place."""
    x, w_q, w_scale, bias = _operands(inputs, 3, 72, 40, "int8", torch.float32)
    wide = torch.zeros(3, 100)
    wide[:, 10:82] = x
    tall = torch.zeros(50, 80, dtype=torch.int8)
    tall[5:45, 4:76] = w_q
    out = _gemv(wide[:, 10:82], tall[5:45, 4:76], w_scale, bias)
    torch.testing.assert_close(out, _gemv(x, w_q, w_scale, bias), rtol=0, atol=0)
    assert _rel(out, _reference(x, w_q, w_scale, bias)) <= TOLERANCE[torch.float32]


@needs_interpreter
def test_gemv_empty_sizes(inputs):
    w_q, w_scale = torch.zeros(8, 0, dtype=torch.int8), torch.rand(8)
    bias = torch.randn(8)
    assert torch.equal(_gemv(torch.randn(2, 0), w_q, w_scale, bias), bias.expand(2, 8))
    assert torch.equal(_gemv(torch.randn(2, 0), w_q, w_scale, None), torch.zeros(2, 8))
    x, w_q, w_scale, _ = _operands(inputs, 1, 40, 24, "int8", torch.float32)
    assert _gemv(x[:0], w_q, w_scale, None).shape == (0, 24)


@pytest.mark.parametrize("args,knobs,match", [
    (dict(m=17), {}, r"takes x with M <= 16 rows; got M=17"),
    (dict(bias_dtype=torch.float16), {}, r"bias must be None or \[N=24\] in x's dtype torch.float32 or float32"),
    (dict(), dict(block_n=24), r"block_n must be None or a power of two from 16 to 256; got 24"),
    (dict(), dict(block_k=8), r"block_k must be None or a power of two from 16 to 1024; got 8"),
    (dict(), dict(num_warps=3), r"num_warps must be None or a power of two from 1 to 16; got 3"),
    (dict(), dict(split_k=0), r"split_k must be None or an int >= 1; got 0"),
    (dict(), dict(num_stages=0), r"num_stages must be None or an int >= 1; got 0"),
    (dict(m=5), dict(use_dot=False), r"use_dot must be None, True, or False with M <= 4; got False for M=5"),
    (dict(), dict(x_tile_load=1), r"x_tile_load must be a bool, .*; got 1 with use_dot=False for M=2"),
    (dict(), dict(x_tile_load=True, use_dot=True),
     r"x_tile_load must be a bool, and True only on the CUDA-core path \(use_dot False, M <= 4\); "
     r"got True with use_dot=True for M=2"),
    (dict(m=5), dict(x_tile_load=True), r"x_tile_load .*; got True with use_dot=True for M=5"),
], ids=["m17", "bias-dtype", "block_n", "block_k", "num_warps", "split_k", "num_stages", "use_dot",
        "x_tile_load-type", "x_tile_load-dot", "x_tile_load-m5"])
def test_gemv_argument_checks(inputs, args, knobs, match):
    pytest.importorskip("triton")
    m = args.get("m", 2)
    x, w_q, w_scale, bias = _operands(inputs, m, 40, 24, "int8", torch.float32, args.get("bias_dtype", "x"))
    with pytest.raises(ValueError, match=match):
        _gemv(x, w_q, w_scale, bias, **knobs)


# ============================================================================ CPU: weight_only_mm


@needs_interpreter
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_weight_only_mm_gemv_backend(inputs, qdtype, x_dtype):
    x, w_q, w_scale, bias = _operands(inputs, 2, 200, 100, qdtype, x_dtype)
    out = weight_only_mm(x, w_q, w_scale, bias, backend="triton_gemv")
    assert out.dtype == x_dtype
    assert _rel(out, _reference(x, w_q, w_scale, bias)) <= TOLERANCE[x_dtype]
    # The module takes the backend too, and its 3-D input [2, 1, K] is M = 2 rows.
    linear = nn.Linear(200, 100)
    layer = QuantizedLinear.from_linear(linear, f"{qdtype}_weight_only", backend="triton_gemv").to(x_dtype)
    x3 = x.reshape(2, 1, 200)
    with torch.no_grad():
        got = layer(x3)
    expected = _reference(x, layer.qweight, layer.weight_scale, layer.bias).reshape(2, 1, 100)
    assert got.shape == (2, 1, 100) and _rel(got, expected) <= TOLERANCE[x_dtype]


def test_weight_only_mm_gemv_errors(inputs):
    x, w_q, w_scale, bias = _operands(inputs, 17, 40, 24, "int8", torch.float32)
    with pytest.raises(ValueError, match=r"backend='triton_gemv' cannot take these inputs: the GEMV takes M <= 16 rows; got M=17"):
        weight_only_mm(x, w_q, w_scale, bias, backend="triton_gemv")
    with pytest.raises(ValueError, match=r"the GEMV takes a bias in x's dtype torch.float32 or float32; got torch.float16"):
        weight_only_mm(x[:2], w_q, w_scale, bias.half(), backend="triton_gemv")
    with pytest.raises(ValueError, match=r"bias must have N=24 elements; got \(23,\)"):
        weight_only_mm(x[:2], w_q, w_scale, bias[:23], backend="triton_gemv")
    with pytest.raises(ValueError, match=r"w_scale must hold N=24 values"):
        weight_only_mm(x[:2], w_q, w_scale[:5], bias)
    if triton_interpreter_enabled():
        with pytest.raises(ValueError, match=r"interpreter's bfloat16 is broken"):
            weight_only_mm(x[:2].bfloat16(), w_q, w_scale, None, backend="triton_gemv")
    else:
        with pytest.raises(ValueError, match=r"the Triton GEMV cannot run: Triton kernels need CUDA tensors"):
            weight_only_mm(x[:2], w_q, w_scale, None, backend="triton_gemv")
    # The GEMV is weight-only: W8A8 callers and layers refuse the name.
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'aten', 'cublaslt', 'triton', 'torch'\); got 'triton_gemv'"):
        scaled_mm(w_q[:2], torch.ones(2, 1), w_q, w_scale, backend="triton_gemv")
    with pytest.raises(ValueError, match=r"backend must be one of .* for method 'int8'; got 'triton_gemv'"):
        QuantizedLinear(32, 16, method="int8", backend="triton_gemv")
    assert WEIGHT_ONLY_BACKENDS == ("auto", "aten", "triton", "torch", "triton_gemv")


def test_auto_order_puts_the_gemv_first_for_few_rows_on_cuda():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for kind in ("int8_weight_only", "fp8_weight_only"):
        assert gemm_backends._auto_order(kind, cuda, 1) == ("triton_gemv", "triton", "aten", "torch")
        assert gemm_backends._auto_order(kind, cuda, 16) == ("triton_gemv", "triton", "aten", "torch")
        assert gemm_backends._auto_order(kind, cuda, 17) == ("triton", "aten", "torch")
        assert gemm_backends._auto_order(kind, cuda, 65) == ("aten", "triton", "torch")
        assert gemm_backends._auto_order(kind, cpu, 1) == ("aten", "torch")
    assert "triton_gemv" not in gemm_backends._auto_order("fp8", cuda, 1)
    assert "triton_gemv" not in gemm_backends._auto_order("int8", cuda, 1)


def test_auto_choice_is_logged_with_what_was_skipped(caplog, monkeypatch):
    """``_choose`` on a CUDA device (decided from the reasons alone, no GPU needed): the GEMV
    when it can run, the next backend with the GEMV's reason logged when it cannot."""
    monkeypatch.setattr(gemm_backends, "_logged_auto_choices", set())
    cuda = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger="omni_kernels.quant.gemm_backends"):
        chosen = gemm_backends._choose("int8_weight_only", "auto", lambda b: None, cuda, 1,
                                      "weight_only_mm", WEIGHT_ONLY_BACKENDS)
        assert chosen == "triton_gemv"
        refused = gemm_backends._choose(
            "int8_weight_only", "auto", lambda b: "no GEMV here (test)" if b == "triton_gemv" else None,
            cuda, 2, "weight_only_mm", WEIGHT_ONLY_BACKENDS)
        assert refused == "triton"
    messages = [r.getMessage() for r in caplog.records if "chose" in r.getMessage()]
    assert any("chose 'triton_gemv' on cuda" in msg for msg in messages), messages
    assert any("chose 'triton' on cuda (skipped triton_gemv: no GEMV here (test))" in msg for msg in messages)
    # On CPU "auto" stays on torch's kernels (the interpreter is for explicit tests).
    x = torch.randn(1, 32)
    w_q, w_scale = quantize_weight(torch.randn(16, 32), "int8")
    with caplog.at_level(logging.INFO, logger="omni_kernels.quant.gemm_backends"):
        weight_only_mm(x, w_q, w_scale)
    assert any("chose 'aten' on cpu" in r.getMessage() for r in caplog.records)


# ============================================================================ CPU: torch.library / compile


@needs_interpreter
@pytest.mark.parametrize("bias_dtype", ["x", None], ids=["bias", "nobias"])
@pytest.mark.parametrize("m", [1, 5])
def test_opcheck_gemv_op(inputs, m, bias_dtype):
    x, w_q, w_scale, bias = _operands(inputs, m, 40, 24, "int8", torch.float32, bias_dtype)
    torch.library.opcheck(torch.ops.omni_kernels.weight_only_gemv_triton, (x, w_q, w_scale, bias),
                          test_utils=OPCHECK_UTILS)


class _Modulation(nn.Module):
    """A DiT's adaLN modulation: SiLU of the conditioning row, one linear, chunked."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(self, emb):
        return self.linear(torch.nn.functional.silu(emb)).chunk(6, dim=-1)[0]


@needs_interpreter
@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_torch_compile_fullgraph_traces_the_gemv(inputs, qdtype, compile_backend):
    torch.manual_seed(inputs.seed)
    block = _Modulation().eval()
    block.linear = QuantizedLinear.from_linear(block.linear, f"{qdtype}_weight_only", backend="triton_gemv")
    emb = inputs.activations((2, 32), torch.float32)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    try:
        with torch.no_grad():
            torch._dynamo.reset()
            traced = torch.compile(block, backend=capture, fullgraph=True)(emb)
            torch._dynamo.reset()
            compiled = torch.compile(block, backend=compile_backend, fullgraph=True)(emb)
            eager = block(emb)
    finally:
        torch._dynamo.reset()
    assert any("weight_only_gemv_triton" in str(node.target) for gm in graphs for node in gm.graph.nodes)
    torch.testing.assert_close(traced, eager, rtol=0, atol=0)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


# ============================================================================ GPU

FLUX_MODULATION_SHAPES = [
    pytest.param(m, 3072, n, id=f"{name}-M{m}")
    for name, n in (("flux-adaln-double", 18432), ("flux-adaln-single", 9216)) for m in (1, 2)
]


def _skip_without_fp8(qdtype):
    if qdtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
@pytest.mark.parametrize("m,k,n", FLUX_MODULATION_SHAPES)
def test_gpu_gemv_at_flux_modulation_shapes(inputs, m, k, n, qdtype):
    """bfloat16 activations and bias: the GEMV against float64, into a poisoned buffer; the
    ``"auto"`` backend takes it and gives the same bits."""
    _skip_without_fp8(qdtype)
    x, w_q, w_scale, bias = _operands(inputs, m, k, n, qdtype, torch.bfloat16, device="cuda")
    buffer, out = _poisoned_out(m, n, torch.bfloat16, "cuda")
    _gemv(x, w_q, w_scale, bias, out=out)
    torch.cuda.synchronize()
    _check_border(buffer, m, n)
    assert torch.isfinite(out).all()
    err = _rel(out, _reference(x, w_q, w_scale, bias))
    print(f"{qdtype} GEMV M={m} {k}->{n}: rel err vs float64 {err:.2e}")
    assert err <= TOLERANCE[torch.bfloat16]
    assert torch.equal(weight_only_mm(x, w_q, w_scale, bias), out)


@pytest.mark.gpu
@pytest.mark.parametrize("num_stages", [None, 3])
@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
@pytest.mark.parametrize("m,k,n", FLUX_MODULATION_SHAPES + [pytest.param(4, 3072, 3072, id="split-k-M4")])
def test_gpu_gemv_x_tile_load(inputs, m, k, n, qdtype, num_stages):
    """``x_tile_load=True``, unpipelined and pipelined, bfloat16: against float64 into a poisoned
    buffer, as accurate as the default load (the sums may be reduced in another order)."""
    _skip_without_fp8(qdtype)
    x, w_q, w_scale, bias = _operands(inputs, m, k, n, qdtype, torch.bfloat16, device="cuda")
    buffer, out = _poisoned_out(m, n, torch.bfloat16, "cuda")
    _gemv(x, w_q, w_scale, bias, x_tile_load=True, num_stages=num_stages, out=out)
    torch.cuda.synchronize()
    _check_border(buffer, m, n)
    assert torch.isfinite(out).all()
    reference = _reference(x, w_q, w_scale, bias)
    err, default_err = _rel(out, reference), _rel(_gemv(x, w_q, w_scale, bias, num_stages=num_stages), reference)
    print(f"{qdtype} GEMV x_tile_load M={m} {k}->{n} stages={num_stages}: rel err {err:.2e} (default load {default_err:.2e})")
    assert err <= TOLERANCE[torch.bfloat16] and err <= 1.5 * default_err + 1e-4


@pytest.mark.gpu
def test_gpu_auto_backend_chooses_the_gemv(inputs, caplog, monkeypatch):
    monkeypatch.setattr(gemm_backends, "_logged_auto_choices", set())
    x, w_q, w_scale, bias = _operands(inputs, 1, 3072, 9216, "int8", torch.bfloat16, device="cuda")
    with caplog.at_level(logging.INFO, logger="omni_kernels.quant.gemm_backends"):
        weight_only_mm(x, w_q, w_scale, bias)
        weight_only_mm(torch.cat([x] * 17), w_q, w_scale, bias)
    messages = [r.getMessage() for r in caplog.records]
    assert any("chose 'triton_gemv' on cuda" in msg for msg in messages), messages
    assert any("chose 'triton' on cuda" in msg for msg in messages), messages


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 8])
def test_gpu_split_k_is_accurate_and_deterministic(inputs, m):
    """N = 3072 < 4096: K may be split (by default where the column blocks are fewer than
    the SMs; here 4 splits asked); the partial sums are added in a fixed order, so repeated
    runs give the same bits."""
    x, w_q, w_scale, bias = _operands(inputs, m, 3072, 3072, "int8", torch.bfloat16, device="cuda")
    out = _gemv(x, w_q, w_scale, bias, split_k=4)
    assert _rel(out, _reference(x, w_q, w_scale, bias)) <= TOLERANCE[torch.bfloat16]
    for _ in range(3):
        assert torch.equal(_gemv(x, w_q, w_scale, bias, split_k=4), out)
    default = _gemv(x, w_q, w_scale, bias)
    assert torch.equal(_gemv(x, w_q, w_scale, bias), default)
    assert _rel(default, _reference(x, w_q, w_scale, bias)) <= TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_inductor_launches_the_gemv(inputs):
    """Under Inductor the triton_op is traced into: its kernel runs from generated code and
    gives eager's result (the SiLU before it may be fused into Inductor's own kernels)."""
    torch.manual_seed(inputs.seed)
    block = _Modulation(3072).to("cuda", torch.bfloat16).eval()
    block.linear = QuantizedLinear.from_linear(block.linear, "int8_weight_only")
    emb = inputs.activations((1, 3072), torch.bfloat16, "cuda")
    emb2 = inputs.activations((2, 3072), torch.bfloat16, "cuda")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            eager = block(emb)
            compiled = torch.compile(block, backend="inductor", fullgraph=True)(emb)
            # dynamic shapes: M symbolic at tracing; the launcher specializes it
            torch._dynamo.reset()
            dynamic = torch.compile(block, backend="inductor", fullgraph=True, dynamic=True)
            dynamic_outs = [dynamic(emb), dynamic(emb2)]
    finally:
        torch._dynamo.reset()
    assert _rel(compiled, eager) <= 1e-2
    assert _rel(dynamic_outs[0], eager) <= 1e-2
    with torch.no_grad():
        assert _rel(dynamic_outs[1], block(emb2)) <= 1e-2
