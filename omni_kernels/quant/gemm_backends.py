"""The GEMM backends: why each cannot take a problem, and ``"auto"``'s choice among them.

* ``"aten"``: ``torch._scaled_mm`` (FP8, row-wise scales, bfloat16 output), ``torch._int_mm``
  (INT8) or, weight-only, the weight dequantized and ``F.linear``.
* ``"cublaslt"`` (FP8 W8A8, CUDA): omni's ``omni_kernels::fp8_gemm_cublaslt``, one cached plan
  per problem whose algorithm the first call tunes; ``"auto"`` takes it on compute capability
  9.0 only, and keeps to ``"aten"`` on a device where it raised.
* ``"triton"``: omni's Triton GEMM, any shape. ``"triton_gemv"`` (weight-only): ``M <= 16``.
* ``"torch"``: the float32 reference, anywhere.

``"auto"`` order: FP8 cublaslt, aten, triton, torch; INT8 triton, aten, torch; weight-only
triton_gemv (``M <= 16``), then triton first for ``M <= 64`` (memory-bound: 1 byte a weight)
and aten first above; on CPU aten, torch. See bench/results/INDEX.md for the measurements.
"""

from __future__ import annotations

import logging

import torch

from omni_kernels._backend_choice import choose_backend
from omni_kernels._device import cuda_index
from omni_kernels._triton import triton_interpreter_enabled, triton_unavailable_reason
from omni_kernels.quant.dispatch import cached_device_capability, device_capability, fp8_unsupported_reason
from omni_kernels.quant.gemm_ops import _HAS_CUBLASLT_OP
from omni_kernels.quant.reference import FP8_DTYPE

logger = logging.getLogger(__name__)

LINEAR_BACKENDS = ("auto", "aten", "cublaslt", "triton", "torch")
#: ``backend`` values of :func:`weight_only_mm` (and weight-only layers): :data:`LINEAR_BACKENDS`
#: but the FP8 W8A8 GEMM ``"cublaslt"``, and the small-M GEMV.
WEIGHT_ONLY_BACKENDS = (*(b for b in LINEAR_BACKENDS if b != "cublaslt"), "triton_gemv")
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

# The compute capabilities where "auto" puts cuBLASLt first: where bench/linear.py compared it
# with torch._scaled_mm. Elsewhere "cublaslt" must be asked for.
_CUBLASLT_AUTO_CAPABILITIES = ((9, 0),)


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
    reasons = {}

    def recorded_reason(candidate):
        reasons[candidate] = reason_of(candidate)
        return reasons[candidate]

    chosen = choose_backend(
        what, backend, _auto_order(kind, device, m), recorded_reason,
        log_key=(what, kind, device.type, m <= GEMV_MAX_M, m <= _WEIGHT_ONLY_SMALL_M),
        describe=lambda: device.type, logged=_logged_auto_choices, logger=logger,
        log_name=f"{what} ({kind})", where="on",
    )
    if backend == "auto" and chosen == "torch" and device.type == "cuda":
        # On a GPU the float32 reference is far too slow to be a silent fallback.
        raise ValueError(
            f"{what} ({kind}): no GPU backend can take these inputs: "
            + "; ".join(f"{b}: {r}" for b, r in reasons.items() if r is not None)
        )
    return chosen
