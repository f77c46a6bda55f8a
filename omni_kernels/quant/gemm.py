"""The GEMM entry points: :func:`scaled_mm` (W8A8) and :func:`weight_only_mm`, and
:func:`quantize_weight`, which makes their weight operands.

Weights are quantized once, per output channel: ``w_q`` ``[N, K]`` (FP8 e4m3 or INT8,
row-major) and ``w_scale`` ``[N]`` float32. The backend is chosen by
:mod:`.gemm_backends`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_kernels._triton import eager_launch_allowed, launch_eagerly
from omni_kernels.quant.dispatch import resolve_quant_dtype
from omni_kernels.quant.gemm_backends import (
    WEIGHT_ONLY_BACKENDS,
    _aten_w8a8_reason,
    _aten_weight_only_reason,
    _choose,
    _cublaslt_failed,
    _cublaslt_reason,
    _gemv_reason,
    _triton_reason,
)
from omni_kernels.quant.gemm_ops import _scaled_mm_triton
from omni_kernels.quant.reference import (
    FP8_DTYPE,
    INT8_DTYPE,
    quantize_weight_reference,
    scaled_linear_reference,
    weight_only_linear_reference,
)


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


# With fast accumulation the FP8 GEMM's error grows with K (about 10x from K=3072 to 12288 on
# activations with outlier channels); above this K "auto" promotes, at some speed cost.
FAST_ACCUM_MAX_K = 8192


def float32_shaped(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t.reshape(shape).float()``, or ``t`` itself in eager mode when it already is that: each
    no-op reshape or cast is still a dispatched torch call, and host time bounds an eager W8A8
    layer at Flux's shapes."""
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
