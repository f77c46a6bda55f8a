"""Quantized linear layers: FP8/INT8 W8A8 and weight-only, with backend choice.

Weights are quantized once, per output channel (:func:`quantize_weight`); a
W8A8 layer quantizes its input per token on every call
(:func:`omni_kernels.quant.quantize_per_token`) and multiplies the two 8-bit
operands; a weight-only layer multiplies its input, as it is, with the
dequantized weight. The GEMM backends:

* ``"aten"``: torch's own kernels. FP8: ``torch._scaled_mm`` with row-wise
  scales (``scale_a`` ``[M, 1]``, ``scale_b`` ``[1, N]`` float32), bias and
  bfloat16 output fused (on CUDA it needs compute capability >= 8.9, a
  bfloat16 output, ``K`` and ``N`` multiples of 16). INT8:
  ``torch._int_mm`` (int32 result; on CUDA ``M > 16``, ``K`` and ``N``
  multiples of 8) and the dequantization, bias and cast as separate torch
  ops. Weight-only: the weight dequantized to the activation dtype
  (``w_q * w_scale`` rounded once) and ``F.linear``.
* ``"cublaslt"`` (FP8 W8A8 only, CUDA): omni's op ``omni_kernels::fp8_gemm_cublaslt``, the
  same cuBLASLt FP8 GEMM with row-wise (outer-vector) scales that ``torch._scaled_mm`` runs on
  Hopper, bias and output cast fused, but with one cached plan per problem (descriptors built
  once: less host time a call) whose algorithm the first call times among cuBLASLt's heuristic
  candidates and the tile/stages/cluster/split-K configurations cuBLASLt accepts, within ~0.25 s
  of GPU time (the stream is synchronized once per new shape; inside CUDA-graph capture the
  heuristic's first choice runs untimed). :func:`fp8_gemm_plans` lists the plans. On the H200
  the GPU time equals ``"aten"``'s at the large Flux/Wan shapes (the same kernel: the tuning
  kept cuBLASLt's first choice there) and the tuning won 5-25% at small M. ``"auto"`` takes it on
  compute capability 9.0 (where it was measured); if it raises there, ``"auto"`` logs the error
  and keeps to ``"aten"`` on that device for the rest of the process.
* ``"triton"``: omni's Triton GEMM (:mod:`.triton_gemm`), dequantization,
  bias and cast fused in its epilogue; takes any shape.
* ``"triton_gemv"`` (weight-only only, :data:`WEIGHT_ONLY_BACKENDS`): omni's Triton
  GEMV (:mod:`.triton_gemv`) for ``M <= 16`` rows (an adaLN modulation's one row per
  sample), which streams the 8-bit weight once at read bandwidth.
* ``"torch"``: the float32 reference (:mod:`.reference`), for tests; runs anywhere.

``"auto"`` order (``bench/linear.py`` measures every pair): FP8 W8A8: cublaslt (sm90 only),
aten, triton, torch (torch's row-wise FP8 GEMM is cuBLASLt's on CUDA >= 12.9, CUTLASS
before). INT8 W8A8: triton, aten, torch (``_int_mm`` writes an int32 ``[M, N]`` that the
separate epilogue reads again).
Weight-only: triton_gemv first for ``M <= 16`` (on the H200 the fastest weight-only
path in 5 of the 6 Flux modulation cases of ``bench/linear.py --shapes flux-adaln``,
e.g. 66 vs 130 us (Triton GEMM) and 346 us (aten) for FP8 at M=1, 3072 -> 18432, yet
slower than bf16 cuBLAS there, 42 us: bench/results/linear-flux-adaln_nvidia-h200_20261130.md),
triton first for ``M <= 64``
(reads 1 byte a weight), aten first above (cuBLAS at bfloat16 speed after one
dequantization pass). On CPU: aten, then torch (the Triton interpreter is for
tests; ask for it with ``backend="triton"`` or ``"triton_gemv"``).

Every traced Triton GEMM launch is the custom op ``torch.ops.omni_kernels.scaled_mm_triton``
and every traced GEMV the ``triton_op`` ``torch.ops.omni_kernels.weight_only_gemv_triton``
(both with fake implementations), and the aten ops have their own, so
``torch.compile(fullgraph=True)`` traces :class:`QuantizedLinear`; eager GEMM and GEMV calls on
plain tensors run the op's body (the launcher) without its dispatch
(:func:`omni_kernels._triton.eager_launch_allowed`). Activation
quantization with ``activation_backend="auto"`` is the custom CUDA/Triton op in
eager mode and plain torch ops under ``torch.compile``, so that Inductor fuses it
with whatever produces the layer's input (:func:`resolve_activation_backend`);
``"torch"`` asks for the torch ops in both modes, ``"cuda"``/``"triton"`` for the
kernels in both. ``"split"`` (opt-in, not yet timed) chooses per layer under
``torch.compile`` by the input width: torch ops for ``K <= split_k``, the kernel
op above (see :func:`resolve_activation_backend`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from omni_kernels._triton import eager_launch_allowed, launch_eagerly, triton_interpreter_enabled, triton_unavailable_reason
from omni_kernels._extension import has_compiled_extension
from omni_kernels._device import cuda_index
from omni_kernels.quant.dispatch import (
    CUDA_STAGED_MAX_ROW,
    QUANTIZE_BACKENDS,
    cached_device_capability,
    device_capability,
    fp8_unsupported_reason,
    quantize_per_token,
    resolve_quant_dtype,
)
from omni_kernels.quant.activated import check_prefix, quantize_activated_per_token
from omni_kernels.quant.reference import (
    FP8_DTYPE,
    INPUT_ACTIVATIONS,
    INT8_DTYPE,
    quantize_weight_reference,
    scaled_linear_reference,
    weight_only_linear_reference,
)

logger = logging.getLogger(__name__)

LINEAR_BACKENDS = ("auto", "aten", "cublaslt", "triton", "torch")
#: ``backend`` values of :func:`weight_only_mm` (and weight-only layers): :data:`LINEAR_BACKENDS`
#: but the FP8 W8A8 GEMM ``"cublaslt"``, and the small-M GEMV.
WEIGHT_ONLY_BACKENDS = (*(b for b in LINEAR_BACKENDS if b != "cublaslt"), "triton_gemv")
#: ``activation_backend`` values of a W8A8 layer: :data:`QUANTIZE_BACKENDS` and ``"split"``.
ACTIVATION_BACKENDS = (*QUANTIZE_BACKENDS, "split")
# An H200 profile of a compiled Flux step (bench/results/pipeline-profile-flux_nvidia-h200_20261129.md):
# Inductor fuses the quantization of K=3072 inputs into one pass with their LayerNorm/modulation,
# but splits the K=15360 proj_out input (cat + GELU) into two passes (10.8 ms a step vs 4.5 ms
# for cat + GELU alone). The threshold between is a guess; the "split" variant of
# bench/pipeline.py is what times it.
DEFAULT_SPLIT_K = 8192
QUANT_METHODS = ("fp8", "int8", "fp8_weight_only", "int8_weight_only")
_METHOD_DTYPES = {
    "fp8": FP8_DTYPE,
    "int8": INT8_DTYPE,
    "fp8_weight_only": FP8_DTYPE,
    "int8_weight_only": INT8_DTYPE,
}
# Weight-only layers with at most this many rows take the Triton GEMM first (memory-bound).
_WEIGHT_ONLY_SMALL_M = 64
# ... and with at most this many the Triton GEMV (omni_kernels.quant.triton_gemv.GEMV_MAX_M,
# not imported from there: that module imports triton).
GEMV_MAX_M = 16
_GEMV_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# torch._scaled_mm on CUDA: K and N multiples of 16; torch._int_mm: M > 16, K and N multiples of 8.
SCALED_MM_ALIGNMENT = 16
_INT_MM_ALIGNMENT = 8
_INT_MM_MIN_M = 17

_logged_auto_choices: set[tuple] = set()


# --------------------------------------------------------------------------- cuBLASLt op


# (An extension built before the op existed lacks it; the "cublaslt" backend then names why.)
_HAS_CUBLASLT_OP = has_compiled_extension() and hasattr(torch.ops.omni_kernels, "fp8_gemm_cublaslt")
# The compute capabilities where "auto" puts cuBLASLt first: where it was measured against
# torch._scaled_mm (bench/linear.py on the H200). Elsewhere "cublaslt" must be asked for.
_CUBLASLT_AUTO_CAPABILITIES = ((9, 0),)
if _HAS_CUBLASLT_OP:
    @torch.library.register_fake("omni_kernels::fp8_gemm_cublaslt")
    def _(a, a_scale, w, w_scale, bias, out_dtype, use_fast_accum, tune):
        return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


def fp8_gemm_plans() -> list[str]:
    """One line per cached plan of the ``"cublaslt"`` FP8 GEMM in this process: the problem
    (device, M, N, K, output dtype, bias, accumulation), cuBLASLt's algorithm (id, tile, stages,
    split-K, cluster) and how it was chosen (tuned: its rank among the timed candidates, its
    time and the heuristic's first choice's). Empty without the compiled op."""
    return list(torch.ops.omni_kernels.fp8_gemm_cublaslt_plans()) if _HAS_CUBLASLT_OP else []


def _cublaslt_problem_reason(device: torch.device, k: int, n: int, out_dtype, auto: bool) -> str | None:
    """Why omni's cuBLASLt FP8 GEMM cannot take a ``[M, K] x [N, K]^T`` problem on ``device``
    (``auto``: or why ``backend="auto"`` passes it over), else ``None``."""
    if device.type != "cuda":
        return f"omni's cuBLASLt GEMM runs on CUDA tensors; got {device}"
    reason = fp8_unsupported_reason(device)
    if reason is not None:
        return reason
    if out_dtype not in (torch.bfloat16, torch.float16):
        return f"omni's cuBLASLt GEMM writes bfloat16 or float16; got out_dtype {out_dtype}"
    if k % SCALED_MM_ALIGNMENT or n % SCALED_MM_ALIGNMENT:
        return f"cuBLASLt's FP8 GEMM needs K and N multiples of {SCALED_MM_ALIGNMENT}; got K={k}, N={n}"
    return _cublaslt_device_reason(device, auto)


def _cublaslt_device_reason(device: torch.device, auto: bool) -> str | None:
    """The part of :func:`_cublaslt_problem_reason` that depends on the build and the device only
    (the op compiled; for ``auto``: the capability, and no earlier failure there)."""
    if not _HAS_CUBLASLT_OP:
        return ("omni_kernels._C has no fp8_gemm_cublaslt op (the compiled extension is missing "
                "or older than the op: build it, e.g. `make build`)")
    if not auto:
        return None
    if cuda_index(device) in _cublaslt_failed_devices:
        return "it failed on this device earlier in this process (logged then); 'auto' keeps to aten"
    # While tracing, the capability an eager call cached (omni_diffusion.quantize checks the GPU
    # eagerly); unknown, aten is kept, as in eager mode on any GPU other than these.
    capability = cached_device_capability(device) if torch.compiler.is_compiling() else device_capability(device)
    if capability not in _CUBLASLT_AUTO_CAPABILITIES:
        allowed = ", ".join(f"{major}.{minor}" for major, minor in _CUBLASLT_AUTO_CAPABILITIES)
        seen = f"{capability[0]}.{capability[1]}" if capability else "not known while tracing"
        return (f"'auto' takes it on compute capability {allowed} only (measured there; this GPU: "
                f"{seen}); ask for backend='cublaslt' elsewhere")
    return None


# Devices on which the cuBLASLt GEMM raised under backend="auto": auto then keeps to aten there.
_cublaslt_failed_devices: set[int] = set()


def _cublaslt_failed(device: torch.device, error: RuntimeError) -> None:
    """Record (and log once) that the cuBLASLt GEMM failed on ``device`` under ``"auto"``."""
    index = cuda_index(device)
    if index not in _cublaslt_failed_devices:
        _cublaslt_failed_devices.add(index)
        logger.warning("omni's cuBLASLt FP8 GEMM failed on %s under backend='auto' (%s); 'auto' uses "
                       "torch._scaled_mm there from now on", device, str(error).splitlines()[0])


def _cublaslt_reason(x_q, w_q, out_dtype, *, auto: bool = False) -> str | None:
    if x_q.dtype != FP8_DTYPE or w_q.dtype != FP8_DTYPE:
        return f"omni's cuBLASLt GEMM is FP8 only; got {x_q.dtype} and {w_q.dtype} operands"
    return _cublaslt_problem_reason(x_q.device, x_q.shape[1], w_q.shape[0], out_dtype, auto)


# --------------------------------------------------------------------------- Triton op


@torch.library.custom_op("omni_kernels::scaled_mm_triton", mutates_args=(), device_types=None)
def _scaled_mm_triton_op(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor | None,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    from omni_kernels.quant.triton_gemm import launch_scaled_gemm_triton

    return launch_scaled_gemm_triton(a, b, a_scale, b_scale, bias, out_dtype, fast_accum)


@_scaled_mm_triton_op.register_fake
def _(a, b, a_scale, b_scale, bias, out_dtype, fast_accum=False):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _scaled_mm_triton(a, b, a_scale, b_scale, bias, out_dtype, fast_accum=False) -> torch.Tensor:
    """The op in traced code; in eager mode on plain tensors the launcher itself (the op would add
    only its dispatch, host time the H200's eager INT8 rows are bound by)."""
    if eager_launch_allowed(a, b, a_scale, b_scale, bias):
        from omni_kernels.quant.triton_gemm import launch_scaled_gemm_triton

        return launch_scaled_gemm_triton(a, b, a_scale, b_scale, bias, out_dtype, fast_accum)
    return torch.ops.omni_kernels.scaled_mm_triton(a, b, a_scale, b_scale, bias, out_dtype, fast_accum)


# A triton_op lets Inductor launch the GEMV kernels itself; the Triton interpreter's kernels
# cannot be traced into (they read data pointers), so under it (CPU tests) the op is opaque.
_register_triton_op = torch.library.custom_op if triton_interpreter_enabled() else torch.library.triton_op


@_register_triton_op("omni_kernels::weight_only_gemv_triton", mutates_args=())
def _weight_only_gemv_triton_op(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    from omni_kernels.quant.triton_gemv import launch_weight_only_gemv

    return launch_weight_only_gemv(x, w_q, w_scale, bias)


@_weight_only_gemv_triton_op.register_fake
def _(x, w_q, w_scale, bias):
    # Explicit, so shape propagation never runs the launcher (fake tensors have no data).
    return x.new_empty((x.shape[0], w_q.shape[0]))


# --------------------------------------------------------------------------- weights


def quantize_weight(weight: torch.Tensor, dtype="fp8") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel quantization of ``weight`` ``[N, K]`` (once, at load time).

    Returns ``(w_q [N, K] contiguous, w_scale [N] float32)`` with
    ``weight ~= w_q * w_scale[:, None]``; runs on the weight's device.
    """
    qdtype = resolve_quant_dtype(dtype)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor [N, K]; got {weight.dtype} {tuple(weight.shape)}")
    w_q, w_scale = quantize_weight_reference(weight.detach(), qdtype)
    return w_q.contiguous(), w_scale.contiguous()


# --------------------------------------------------------------------------- eligibility


def _aten_w8a8_reason(x_q, w_q, out_dtype) -> str | None:
    m, k = x_q.shape
    n = w_q.shape[0]
    if x_q.dtype == FP8_DTYPE:
        if x_q.device.type == "cuda":
            reason = fp8_unsupported_reason(x_q.device)
            if reason is not None:
                return reason
            if out_dtype != torch.bfloat16:
                return f"torch._scaled_mm with row-wise scales writes bfloat16 only; got out_dtype {out_dtype}"
            if k % SCALED_MM_ALIGNMENT or n % SCALED_MM_ALIGNMENT:
                return (
                    f"torch._scaled_mm needs K and N multiples of {SCALED_MM_ALIGNMENT}; got K={k}, N={n}"
                )
        return None
    if x_q.device.type == "cuda":
        if m < _INT_MM_MIN_M:
            return f"torch._int_mm on CUDA needs M > 16; got M={m}"
        if k % _INT_MM_ALIGNMENT or n % _INT_MM_ALIGNMENT:
            return f"torch._int_mm on CUDA needs K and N multiples of {_INT_MM_ALIGNMENT}; got K={k}, N={n}"
    return None


def _triton_reason(a, w_q, out_dtype) -> str | None:
    reason = triton_unavailable_reason(a.device)
    if reason is not None:
        return f"the Triton GEMM cannot run: {reason}"
    if a.device.type == "cpu" and triton_interpreter_enabled():
        if FP8_DTYPE in (a.dtype, w_q.dtype):
            return "the Triton interpreter has no float8 (use backend='torch' or 'aten' on CPU)"
        if torch.bfloat16 in (a.dtype, out_dtype):
            return "the Triton interpreter's bfloat16 is broken (use float16/float32 on CPU)"
    if FP8_DTYPE in (a.dtype, w_q.dtype):
        reason = fp8_unsupported_reason(a.device)
        if reason is not None:
            return reason
    return None


def _aten_weight_only_reason(x, w_q) -> str | None:
    if w_q.dtype == FP8_DTYPE:
        return fp8_unsupported_reason(x.device)
    return None


def _gemv_reason(x, w_q, bias) -> str | None:
    """Why the Triton GEMV (:mod:`.triton_gemv`) cannot take these inputs, else ``None``."""
    m = x.shape[0]
    if m > GEMV_MAX_M:
        return f"the GEMV takes M <= {GEMV_MAX_M} rows; got M={m} (the 'triton' or 'aten' GEMM takes any M)"
    if x.dtype not in _GEMV_X_DTYPES:
        return f"the GEMV takes x in float16, bfloat16 or float32; got {x.dtype}"
    if bias is not None and bias.dtype not in (x.dtype, torch.float32):
        return f"the GEMV takes a bias in x's dtype {x.dtype} or float32; got {bias.dtype}"
    reason = triton_unavailable_reason(x.device)
    if reason is not None:
        return f"the Triton GEMV cannot run: {reason}"
    if x.device.type == "cpu" and triton_interpreter_enabled() and x.dtype == torch.bfloat16:
        return "the Triton interpreter's bfloat16 is broken (use float16/float32 on CPU)"
    if w_q.dtype == FP8_DTYPE and x.device.type == "cuda":
        return fp8_unsupported_reason(x.device)
    return None


def _auto_order(kind: str, device: torch.device, m: int) -> tuple[str, ...]:
    if device.type != "cuda":
        return ("aten", "torch")
    if kind == "fp8":
        return ("cublaslt", "aten", "triton", "torch")
    if kind == "int8":
        return ("triton", "aten", "torch")
    if m <= GEMV_MAX_M:
        return ("triton_gemv", "triton", "aten", "torch")
    return ("triton", "aten", "torch") if m <= _WEIGHT_ONLY_SMALL_M else ("aten", "triton", "torch")


def _choose(kind, backend, reason_of, device, m, what, allowed=LINEAR_BACKENDS):
    """The backend to run: ``backend`` itself (``ValueError`` if it cannot), or the first eligible.

    ``"auto"`` logs its choice (and why faster backends were skipped) once per kind of input."""
    if backend not in allowed:
        raise ValueError(f"backend must be one of {allowed}; got {backend!r}")
    if backend != "auto":
        reason = reason_of(backend)
        if reason is not None:
            raise ValueError(f"{what} backend={backend!r} cannot take these inputs: {reason}")
        return backend
    reasons = {}
    chosen = "torch"
    for candidate in _auto_order(kind, device, m):
        reasons[candidate] = reason_of(candidate)
        if reasons[candidate] is None:
            chosen = candidate
            break
    key = (what, kind, chosen, device.type, m <= GEMV_MAX_M, m <= _WEIGHT_ONLY_SMALL_M)
    if key not in _logged_auto_choices and not torch.compiler.is_compiling():
        _logged_auto_choices.add(key)
        skipped = "; ".join(f"{b}: {r}" for b, r in reasons.items() if r is not None)
        logger.info(
            "%s (%s) backend='auto' chose %r on %s%s", what, kind, chosen, device.type,
            f" (skipped {skipped})" if skipped else "",
        )
    if chosen == "torch" and device.type == "cuda" and reasons:
        # On a GPU the float32 reference is far too slow to be a silent fallback.
        raise ValueError(
            f"{what} ({kind}): no GPU backend can take these inputs: "
            + "; ".join(f"{b}: {r}" for b, r in reasons.items() if r is not None)
        )
    return chosen


# --------------------------------------------------------------------------- GEMMs


# Measured on an H200 (bench/results/linear_nvidia-h200_20261129.md, activations with
# outlier channels): with fast accumulation the FP8 GEMM's error against the same
# operands in float32 grew from ~1.6e-2 at K=3072 to 1.2e-1 at K=12288 (Flux's MLP
# down projection), against ~3e-3 when promoted; the promoted GEMM costs ~8-20%.
FAST_ACCUM_MAX_K = 8192


def float32_shaped(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t.reshape(shape).float()``, or ``t`` itself in eager mode when it already is that: each
    no-op reshape or cast is still a dispatched torch call, and an eager W8A8 layer's host time
    is what bounds it at Flux's shapes on a slow host (bench/linear.py's host us column)."""
    if t.dtype == torch.float32 and t.shape == shape and not torch.compiler.is_compiling():
        return t
    return t.reshape(shape).float()


def resolve_fast_accum(fast_accum: bool | str, k: int) -> bool:
    """``True``/``False`` as given; ``"auto"``: fast accumulation only for ``K <= FAST_ACCUM_MAX_K``."""
    if fast_accum == "auto":
        return k <= FAST_ACCUM_MAX_K
    if not isinstance(fast_accum, bool):
        raise ValueError(f"fast_accum must be True, False or 'auto'; got {fast_accum!r}")
    return fast_accum


def scaled_mm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str = "auto",
    fast_accum: bool | str = "auto",
) -> torch.Tensor:
    """W8A8 GEMM: ``(x_q * x_scale) @ (w_q * w_scale)^T + bias`` as ``[M, N]`` ``out_dtype``.

    ``x_q`` ``[M, K]`` and ``w_q`` ``[N, K]`` both FP8 e4m3 or both INT8, row-major;
    ``x_scale`` ``[M, 1]`` float32, ``w_scale`` ``[N]`` float32; ``bias`` ``[N]``.
    ``fast_accum`` (FP8 only): ``True`` lets Hopper's tensor cores accumulate all
    of K in reduced precision (``torch._scaled_mm``'s ``use_fast_accum``), ``False``
    promotes to float32 after every MMA, ``"auto"`` is :func:`resolve_fast_accum`.
    """
    if x_q.dim() != 2 or w_q.dim() != 2 or x_q.shape[1] != w_q.shape[1]:
        raise ValueError(f"x_q [M, K] and w_q [N, K] must agree in K; got {tuple(x_q.shape)}, {tuple(w_q.shape)}")
    if x_q.dtype != w_q.dtype or x_q.dtype not in (FP8_DTYPE, INT8_DTYPE):
        raise ValueError(f"x_q and w_q must both be float8_e4m3fn or both int8; got {x_q.dtype}, {w_q.dtype}")
    m, n = x_q.shape[0], w_q.shape[0]
    if x_scale.numel() != m or w_scale.numel() != n:
        raise ValueError(
            f"x_scale must hold M={m} and w_scale N={n} values; got {tuple(x_scale.shape)}, {tuple(w_scale.shape)}"
        )
    if bias is not None and bias.numel() != n:
        raise ValueError(f"bias must have N={n} elements; got {tuple(bias.shape)}")
    kind = "fp8" if x_q.dtype == FP8_DTYPE else "int8"
    fast_accum = resolve_fast_accum(fast_accum, x_q.shape[1])

    def reason_of(candidate):
        if candidate == "aten":
            return _aten_w8a8_reason(x_q, w_q, out_dtype)
        if candidate == "cublaslt":
            return _cublaslt_reason(x_q, w_q, out_dtype, auto=backend == "auto")
        if candidate == "triton":
            return _triton_reason(x_q, w_q, out_dtype)
        return None

    chosen = _choose(kind, backend, reason_of, x_q.device, m, "scaled_mm")
    x_scale = float32_shaped(x_scale, (m, 1))
    if chosen == "cublaslt":
        try:
            return torch.ops.omni_kernels.fp8_gemm_cublaslt(
                x_q, x_scale, w_q, float32_shaped(w_scale, (n,)),
                bias if bias is None or bias.dtype == out_dtype else bias.to(out_dtype),
                out_dtype, fast_accum, True,
            )
        except RuntimeError as error:
            if backend != "auto" or torch.compiler.is_compiling():
                raise
            _cublaslt_failed(x_q.device, error)
            chosen = "aten"
    if kind == "fp8" and chosen == "aten":
        return torch._scaled_mm(
            x_q, w_q.t(), scale_a=x_scale, scale_b=float32_shaped(w_scale, (1, n)),
            bias=bias if bias is None or bias.dtype == out_dtype else bias.to(out_dtype),
            out_dtype=out_dtype, use_fast_accum=fast_accum,
        )
    w_scale = float32_shaped(w_scale, (n,))
    if chosen == "torch":
        return scaled_linear_reference(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    if chosen == "triton":
        return _scaled_mm_triton(x_q, w_q, x_scale, w_scale, bias, out_dtype, fast_accum)
    acc = torch._int_mm(x_q, w_q.t())
    out = acc.to(torch.float32) * x_scale * w_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def weight_only_mm(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Weight-only GEMM: ``x @ (w_q * w_scale)^T + bias`` as ``[M, N]`` in ``x``'s dtype.

    ``x`` ``[M, K]`` float16/bfloat16/float32; ``w_q`` ``[N, K]`` FP8 e4m3 or INT8;
    ``w_scale`` ``[N]`` float32; ``bias`` ``[N]`` or ``None``. ``backend`` is one of
    :data:`WEIGHT_ONLY_BACKENDS`; ``"triton_gemv"`` takes ``M <= 16`` rows and a bias in
    ``x``'s dtype or float32 (``ValueError`` naming what it cannot take).
    """
    if x.dim() != 2 or w_q.dim() != 2 or x.shape[1] != w_q.shape[1]:
        raise ValueError(f"x [M, K] and w_q [N, K] must agree in K; got {tuple(x.shape)}, {tuple(w_q.shape)}")
    if w_q.dtype not in (FP8_DTYPE, INT8_DTYPE):
        raise ValueError(f"w_q must be float8_e4m3fn or int8; got {w_q.dtype}")
    m, n = x.shape[0], w_q.shape[0]
    if w_scale.numel() != n:
        raise ValueError(f"w_scale must hold N={n} values; got {tuple(w_scale.shape)}")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"bias must have N={n} elements; got {tuple(bias.shape)}")
    kind = "fp8_weight_only" if w_q.dtype == FP8_DTYPE else "int8_weight_only"

    def reason_of(candidate):
        if candidate == "aten":
            return _aten_weight_only_reason(x, w_q)
        if candidate == "triton":
            return _triton_reason(x, w_q, x.dtype)
        if candidate == "triton_gemv":
            return _gemv_reason(x, w_q, bias)
        return None

    chosen = _choose(kind, backend, reason_of, x.device, m, "weight_only_mm", WEIGHT_ONLY_BACKENDS)
    w_scale = float32_shaped(w_scale, (n,))
    if chosen == "torch":
        return weight_only_linear_reference(x, w_q, w_scale, bias)
    if chosen == "triton":
        return _scaled_mm_triton(x, w_q, None, w_scale, bias, x.dtype)
    if chosen == "triton_gemv":
        bias = bias if bias is None or bias.dim() == 1 else bias.reshape(n)
        if eager_launch_allowed(x, w_q, w_scale, bias):  # the launcher itself: the op adds only dispatch here
            from omni_kernels.quant.triton_gemv import launch_weight_only_gemv

            return launch_eagerly(launch_weight_only_gemv, x, w_q, w_scale, bias)
        return torch.ops.omni_kernels.weight_only_gemv_triton(x, w_q, w_scale, bias)
    # One pass dequantizes into x's dtype (the scale rounded to it: 2**-9 relative in bfloat16).
    weight = w_q.to(x.dtype) * w_scale.to(x.dtype)[:, None]
    return F.linear(x, weight, bias.to(x.dtype) if bias is not None else None)


def check_split_k(split_k, activation_backend: str, owner: str = "split_k") -> int | None:
    """Validate ``split_k`` (``None`` or an int >= 0, only with ``activation_backend="split"``);
    returns it with ``None`` resolved to :data:`DEFAULT_SPLIT_K` for ``"split"``."""
    if split_k is None:
        return DEFAULT_SPLIT_K if activation_backend == "split" else None
    if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 0:
        raise ValueError(f"{owner} must be None or an int >= 0 (an input width K); got {split_k!r}")
    if activation_backend != "split":
        raise ValueError(
            f"{owner}={split_k} applies only to activation_backend='split'; "
            f"got activation_backend={activation_backend!r}"
        )
    return split_k


def resolve_activation_backend(activation_backend: str, k: int | None = None,
                               split_k: int | None = None) -> str:
    """The :func:`quantize_per_token` backend a W8A8 layer with input width ``k`` runs.

    ``"auto"`` while ``torch.compile`` traces is ``"torch"``; ``"split"`` while it
    traces is ``"torch"`` for ``k <= split_k`` (default :data:`DEFAULT_SPLIT_K`) and
    ``"auto"`` (the kernels' own choice: omni's CUDA or Triton op, the torch ops
    only where neither can take the input) above; in eager mode both are
    ``"auto"``. Any other value is itself.

    Under ``torch.compile`` the CUDA and Triton kernels are opaque custom ops:
    Inductor must write their input (the LayerNorm + adaLN modulation or the
    GELU before the layer) in bfloat16, and the kernel reads it back and writes
    it again in 8 bits. The ``"torch"`` backend is the reference's plain torch
    ops (per-row absolute maximum, scale, clamp, round/cast: exactly
    :func:`~omni_kernels.quant.reference.quantize_per_token_reference`), which
    Inductor fuses into the kernel that produces the input. In eager mode
    ``"auto"`` keeps the custom kernels (the reference is a slow float32 path there).

    Inductor does not fuse every producer equally well: a wide input built by a
    ``cat`` and a GELU (Flux's single blocks' ``proj_out``, K=15360) was split into
    two passes over it, more than the kernel's one read of the materialized
    input. ``"split"`` gives such wide layers the kernel and keeps the fused torch
    ops for the narrow ones.
    """
    if activation_backend == "split":
        if k is None:
            raise ValueError("activation_backend='split' needs the layer's input width k")
        if not torch.compiler.is_compiling():
            return "auto"
        split_k = DEFAULT_SPLIT_K if split_k is None else split_k
        return "torch" if k <= split_k else "auto"
    if activation_backend == "auto" and torch.compiler.is_compiling():
        return "torch"
    return activation_backend


def activated_quantize_backend(activation_backend: str) -> str:
    """The :func:`~omni_kernels.quant.quantize_activated_per_token` backend of a layer whose
    ``activation_backend`` is this: ``"cuda"``, ``"triton"`` and ``"torch"`` as they are;
    ``"auto"`` and ``"split"`` are ``"auto"`` in eager mode and under ``torch.compile`` alike
    (the fused kernel reads the pre-activation once, which is what Inductor's own fusion of a
    wide GELU and quantization did not manage)."""
    if activation_backend in ("auto", "split"):
        return "auto"
    if activation_backend in ("cuda", "torch", "triton"):
        return activation_backend
    raise ValueError(
        f"input_activation: the activation-fused quantization has CUDA, Triton and torch backends; "
        f"activation_backend={activation_backend!r} (allowed with it: 'auto', 'split', 'cuda', 'triton', 'torch')"
    )


def quantized_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    method: str,
    *,
    backend: str = "auto",
    activation_backend: str = "auto",
    clamp: float | None = None,
    fast_accum: bool | str = "auto",
    split_k: int | None = None,
    input_activation: str | None = None,
    activation_from: int = 0,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """``nn.Linear`` on ``x`` ``[..., K]`` with a quantized weight; output in ``x``'s dtype.

    ``method`` is one of :data:`QUANT_METHODS`; W8A8 methods quantize ``x`` per
    token first (with ``clamp`` and ``activation_backend``, which
    :func:`resolve_activation_backend` resolves with ``K`` and ``split_k``: plain
    torch ops under ``torch.compile`` for ``"auto"``). With ``input_activation``
    (W8A8 only), the layer computes ``linear(activated(x))``:
    :func:`~omni_kernels.quant.quantize_activated_per_token` applies it to the
    columns ``activation_from:`` of ``x`` in the quantization pass.

    ``prefix`` ``[..., K0]`` (``x``'s leading shape, dtype and device) makes the input
    ``cat([prefix, x], -1)``, the result that of this function on it. When the activation
    starts right after the prefix (``input_activation`` set, ``activation_from == K0``), the
    quantization reads the two in place and the ``cat`` is never materialized; otherwise it is.
    """
    if method not in QUANT_METHODS:
        raise ValueError(f"method must be one of {QUANT_METHODS}; got {method!r}")
    if prefix is not None:
        check_prefix(prefix, x)
        if input_activation is None or activation_from != prefix.shape[-1]:
            x, prefix = torch.cat([prefix, x], -1), None
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # (a reshape is a dispatched call even when a no-op)
    if input_activation is not None:
        if method.endswith("_weight_only"):
            raise ValueError(f"input_activation needs a W8A8 method; got method {method!r}")
        if prefix is not None:
            # The activation covers all of x; the prefix passes through (see quantize_activated_per_token).
            prefix, activation_from = prefix.reshape(x2.shape[0], prefix.shape[-1]), 0
        x_q, x_scale = quantize_activated_per_token(
            x2, w_q.dtype, activation=input_activation, activation_from=activation_from, clamp=clamp,
            backend=activated_quantize_backend(activation_backend), prefix=prefix,
        )
        out = scaled_mm(x_q, x_scale, w_q, w_scale, bias, x.dtype, backend=backend, fast_accum=fast_accum)
    elif method.endswith("_weight_only"):
        out = weight_only_mm(x2, w_q, w_scale, bias, backend=backend)
    elif (gemm := fused_fp8_eager_gemm(x2, w_q, w_scale, bias, backend, activation_backend)) is not None:
        if ("fused_fp8", gemm) not in _logged_auto_choices:
            _logged_auto_choices.add(("fused_fp8", gemm))
            logger.info("quantized_linear (fp8) in eager mode: one op, omni's CUDA per-token "
                        "quantization then the FP8 GEMM %r (omni_kernels::quantized_linear_fp8)", gemm)
        args = (x2, w_q, w_scale, bias, float(clamp) if clamp is not None else 0.0, resolve_fast_accum(fast_accum, k))
        try:
            out = torch.ops.omni_kernels.quantized_linear_fp8(*args, gemm)
        except RuntimeError as error:
            if backend != "auto" or gemm == "aten":
                raise
            _cublaslt_failed(x2.device, error)
            out = torch.ops.omni_kernels.quantized_linear_fp8(*args, "aten")
    else:
        x_q, x_scale = quantize_per_token(
            x2, w_q.dtype, clamp=clamp, backend=resolve_activation_backend(activation_backend, k, split_k)
        )
        out = scaled_mm(x_q, x_scale, w_q, w_scale, bias, x.dtype, backend=backend, fast_accum=fast_accum)
    return out if x.dim() == 2 else out.reshape(*lead, w_q.shape[0])


def fused_fp8_eager_gemm(
    x2: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    backend: str, activation_backend: str,
) -> str | None:
    """The ``gemm`` argument with which an eager FP8 W8A8 call on ``x2`` ``[M, K]`` may run as the
    one op ``torch.ops.omni_kernels.quantized_linear_fp8`` (omni's CUDA per-token quantization,
    then the FP8 GEMM, from C++), or ``None`` where it may not. The op runs exactly what the
    two-call path's choices run there (the CUDA op's staged kernel, then the GEMM ``backend``
    resolves to: ``"cublaslt_tuned"`` for ``"cublaslt"``, ``"aten"`` for ``"aten"``), for one
    dispatched call instead of two with their Python checks. On the H200's host an eager FP8
    layer at Flux's 4608 x 3072 -> 3072 took 66-86 us of host time against ~80 us of GPU time
    (bench/results/linear-flux-eager-auto_*): the host bounded it.

    Needs: eager mode without dispatch modes on plain tensors, the compiled extension, CUDA
    bfloat16 ``x2`` with 16-byte aligned rows, ``K <= CUDA_STAGED_MAX_ROW``, ``K`` and ``N``
    multiples of 16, a GPU with FP8 tensor cores, a bias in bfloat16 or none, ``backend``
    ``"auto"``, ``"cublaslt"`` or ``"aten"``, and ``activation_backend`` naming the CUDA kernel
    (``"auto"``, ``"cuda"`` or ``"split"``, which are that kernel in eager mode)."""
    if backend not in ("auto", "cublaslt", "aten") or activation_backend not in ("auto", "cuda", "split"):
        return None
    # First: under torch.compile or a dispatch mode the tensors may be fake (no data_ptr).
    if not _HAS_FUSED_FP8_OP or not eager_launch_allowed(x2, w_q, w_scale, bias):
        return None
    if x2.dtype != torch.bfloat16 or not x2.is_cuda or w_q.dtype != FP8_DTYPE:
        return None
    k, n = x2.shape[1], w_q.shape[0]
    # Anything the op would refuse takes the two-call path, whose checks raise ValueError.
    if w_q.dim() != 2 or w_q.shape[1] != k or k > CUDA_STAGED_MAX_ROW or k % SCALED_MM_ALIGNMENT or n % SCALED_MM_ALIGNMENT:
        return None
    if x2.shape[0] == 0 or x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,)):
        return None
    if w_scale.dtype != torch.float32 or w_scale.numel() != n or not w_scale.is_contiguous():
        return None
    if fp8_unsupported_reason(x2.device) is not None:
        return None
    if backend == "aten":
        return "aten"
    # (CUDA, FP8, bfloat16 output, K and N: checked above)
    if _cublaslt_device_reason(x2.device, backend == "auto") is None:
        return "cublaslt_tuned"
    # "cublaslt" asked for and refused: the two-call path raises the reason.
    return "aten" if backend == "auto" else None


def _fake_quantized_linear_fp8(x, w_q, w_scale, bias, clamp, use_fast_accum, gemm):
    return x.new_empty((x.shape[0], w_q.shape[0]))


# (An extension built before the op existed, or before its `gemm` argument, serves no call: the
# two-call path then serves every call.)
_HAS_FUSED_FP8_OP = (
    has_compiled_extension() and hasattr(torch.ops.omni_kernels, "quantized_linear_fp8")
    and [a.name for a in torch.ops.omni_kernels.quantized_linear_fp8.default._schema.arguments][-1] == "gemm"
)
if _HAS_FUSED_FP8_OP:
    torch.library.register_fake("omni_kernels::quantized_linear_fp8")(_fake_quantized_linear_fp8)


# --------------------------------------------------------------------------- module


class QuantizedLinear(nn.Module):
    """A drop-in replacement of ``nn.Linear`` (inference only) holding an 8-bit weight.

    State: ``qweight`` ``[out, in]`` (``torch.float8_e4m3fn`` or ``torch.int8``)
    and ``weight_scale`` ``[out]`` float32 buffers, and ``bias`` (a parameter
    without grad, in the model dtype) if the layer has one; these names are the
    ``state_dict`` keys. ``module.to(dtype)`` / ``.half()`` convert the bias
    only: the 8-bit weight and its float32 scales keep their dtypes.

    Output dtype = input dtype. W8A8 methods (``"fp8"``, ``"int8"``) quantize
    the input per token on every call; weight-only methods do not. ``backend`` is one
    of :data:`LINEAR_BACKENDS`, for weight-only methods one of :data:`WEIGHT_ONLY_BACKENDS`
    (``"triton_gemv"`` then needs at most 16 input rows).
    ``activation_backend`` is one of :data:`ACTIVATION_BACKENDS`; ``split_k``
    (``None``: :data:`DEFAULT_SPLIT_K`) is the widest input that
    ``activation_backend="split"`` quantizes with torch ops under ``torch.compile``
    (:func:`resolve_activation_backend`); it is an error with any other backend.
    ``input_activation`` (W8A8 only; ``None`` or one of
    :data:`~omni_kernels.quant.reference.INPUT_ACTIVATIONS`) makes the layer compute
    ``linear(activated(x))``, the activation applied to the input columns
    ``activation_from:`` inside the quantization pass (:func:`quantized_linear`):
    :func:`omni_diffusion.quantization.quantize` sets it on the layers that read a
    GELU's output and removes that GELU module.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        method: str = "fp8",
        *,
        device=None,
        dtype: torch.dtype | None = None,
        backend: str = "auto",
        activation_backend: str = "auto",
        clamp: float | None = None,
        fast_accum: bool | str = "auto",
        split_k: int | None = None,
        input_activation: str | None = None,
        activation_from: int = 0,
    ) -> None:
        super().__init__()
        if method not in QUANT_METHODS:
            raise ValueError(f"method must be one of {QUANT_METHODS}; got {method!r}")
        allowed = WEIGHT_ONLY_BACKENDS if method.endswith("_weight_only") else LINEAR_BACKENDS
        if backend not in allowed or (backend == "cublaslt" and method != "fp8"):
            allowed = tuple(b for b in allowed if b != "cublaslt" or method == "fp8")
            raise ValueError(f"backend must be one of {allowed} for method {method!r}; got {backend!r}")
        if activation_backend not in ACTIVATION_BACKENDS:
            raise ValueError(f"activation_backend must be one of {ACTIVATION_BACKENDS}; got {activation_backend!r}")
        self.split_k = check_split_k(split_k, activation_backend)
        self.set_input_activation(input_activation, activation_from, method=method, in_features=in_features,
                                  activation_backend=activation_backend)
        self.in_features = in_features
        self.out_features = out_features
        self.method = method
        self.backend = backend
        self.activation_backend = activation_backend
        self.clamp = clamp
        resolve_fast_accum(fast_accum, in_features)  # validates
        self.fast_accum = fast_accum
        qdtype = _METHOD_DTYPES[method]
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=qdtype, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(out_features, dtype=dtype or torch.float32, device=device), requires_grad=False
            )
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: str, **options) -> QuantizedLinear:
        """Quantize ``linear``'s weight per output channel into a new module on its device."""
        weight = linear.weight
        module = cls(
            linear.in_features, linear.out_features, linear.bias is not None, method,
            device=weight.device, dtype=weight.dtype, **options,
        )
        q, scale = quantize_weight(weight, _METHOD_DTYPES[method])
        module.qweight.copy_(q)
        module.weight_scale.copy_(scale)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module

    def set_input_activation(self, activation: str | None, activation_from: int = 0, *, method: str | None = None,
                             in_features: int | None = None, activation_backend: str | None = None) -> None:
        """Set (or, with ``None``, clear) the activation applied to the input columns
        ``activation_from:`` before quantization; ``ValueError`` for a weight-only layer, an
        unknown activation, a column outside ``[0, in_features)`` or ``activation_backend="cuda"``."""
        method = method or self.method
        in_features = in_features if in_features is not None else self.in_features
        if activation is not None:
            if activation not in INPUT_ACTIVATIONS:
                raise ValueError(f"input_activation must be None or one of {INPUT_ACTIVATIONS}; got {activation!r}")
            if method.endswith("_weight_only"):
                raise ValueError(f"input_activation needs a W8A8 method; got method {method!r}")
            activated_quantize_backend(activation_backend or self.activation_backend)
        if isinstance(activation_from, bool) or not isinstance(activation_from, int) or not (
            0 <= activation_from < max(in_features, 1)
        ):
            raise ValueError(f"activation_from must be an int in [0, in_features={in_features}); got {activation_from!r}")
        self.input_activation = activation
        self.activation_from = activation_from if activation is not None else 0

    @property
    def weight_only(self) -> bool:
        return self.method.endswith("_weight_only")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._quantized_linear(x)

    def _quantized_linear(self, x: torch.Tensor, prefix: torch.Tensor | None = None) -> torch.Tensor:
        return quantized_linear(
            x, self.qweight, self.weight_scale, self.bias, self.method, backend=self.backend,
            activation_backend=self.activation_backend, clamp=self.clamp, fast_accum=self.fast_accum,
            split_k=self.split_k, input_activation=self.input_activation, activation_from=self.activation_from,
            prefix=prefix,
        )

    def forward_concat(self, head: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """``self(torch.cat([head, tail], -1))``, the same values, for ``head`` ``[..., K0]`` and
        ``tail`` ``[..., in_features - K0]`` (same leading shape, dtype and device).

        A W8A8 layer whose ``input_activation`` starts at column ``K0`` (Flux's single blocks'
        ``proj_out`` on ``cat(attention output, proj_mlp output)``) quantizes the two in place,
        the ``cat`` never written (:func:`quantized_linear`'s ``prefix``); any other layer
        concatenates and runs :meth:`forward`'s path on the ``cat``.
        """
        return self._quantized_linear(tail, prefix=head)

    def forward_quantized(
        self, x_q: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """W8A8 on an input already quantized (``[..., K]`` and ``[..., 1]``), e.g. by a
        norm/adaLN-fused :func:`~omni_kernels.quant.quantize_per_token`, which then
        replaces this layer's own quantization pass."""
        if self.weight_only:
            raise ValueError(f"forward_quantized needs a W8A8 method; this layer is {self.method!r}")
        if self.input_activation is not None:
            raise ValueError(
                f"forward_quantized takes an input already quantized, but this layer applies "
                f"{self.input_activation!r} to its input before quantizing it"
            )
        if x_q.dtype != self.qweight.dtype:
            raise ValueError(f"x_q must be {self.qweight.dtype} for method {self.method!r}; got {x_q.dtype}")
        lead, k = x_q.shape[:-1], x_q.shape[-1]
        out = scaled_mm(
            x_q.reshape(-1, k), x_scale.reshape(-1, 1), self.qweight, self.weight_scale, self.bias,
            out_dtype, backend=self.backend, fast_accum=self.fast_accum,
        )
        return out.reshape(*lead, self.out_features)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``qweight * weight_scale[:, None]`` in ``dtype`` (for inspection and tests)."""
        return (self.qweight.float() * self.weight_scale[:, None]).to(dtype)

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype) converts every floating-point tensor, and float8 counts as one:
        # keep the 8-bit weight and the float32 scales in their dtypes (only devices change).
        before = {name: buf for name, buf in self._buffers.items() if buf is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, method={self.method!r}, backend={self.backend!r}"
            + (f", activation_backend='split', split_k={self.split_k}" if self.activation_backend == "split" else "")
            + (f", input_activation={self.input_activation!r}"
               + (f", activation_from={self.activation_from}" if self.activation_from else "")
               if self.input_activation is not None else "")
        )
