"""PyTorch reference for per-token activation quantization and quantized linear layers.

This is the definition the Triton and CUDA kernels are tested against, and the
``backend="torch"`` path of :mod:`omni_kernels.quant`.

Activation quantization, per row of ``x`` (``[M, K]``; a row is one token), in
float32, in this order (each step optional)::

    norm:      "layer": d = x - mean(x);  y = d * 1/sqrt(mean(d*d) + eps)    (LayerNorm, two-pass)
               "rms":   y = x * 1/sqrt(mean(x*x) + eps)                        (RMSNorm)
    affine:    y = y * norm_weight;  y = y + norm_bias
    adaLN:     y = y * (1 + mod_scale[g]) + mod_shift[g]      g = row // (M // G), mod_* [G, K]
    clamp:     y = clamp(y, -clamp, clamp)
    scale:     amax  = max(max|y|, MIN_ABSMAX)                one per row
               scale = amax / QMAX                            (float32, stored: x ~= q * scale)
               q     = round(clamp(y * (QMAX / amax), -QMAX, QMAX))

``QMAX`` is 448 for FP8 e4m3 (``torch.float8_e4m3fn``, rounded to nearest even,
saturating) and 127 for INT8 (round half to even; -128 is never produced, so
the range is symmetric). ``MIN_ABSMAX`` guards all-zero rows: they get
``q = 0`` and a tiny positive scale, so nothing divides by zero and
dequantization returns exact zeros. E.g. the row ``[1, -4, 2]`` quantizes to
INT8 ``[32, -127, 64]`` with scale ``4/127``.

The fused kernels compute ``y`` in float32 without rounding it to the input
dtype first (diffusers rounds the norm's and the modulation's outputs to
bfloat16), which is closer to the exact value.

Weights are quantized once, per output channel: each row ``n`` of ``[N, K]``
gets its own scale, by the same formula (no norm, no clamp).

Quantized linear layers compute ``y = (x_q * x_scale) @ (w_q * w_scale)^T + bias``:
the reference dequantizes and multiplies in float32, then rounds to the output dtype.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
INT8_DTYPE = torch.int8
QUANT_DTYPES = (FP8_DTYPE, INT8_DTYPE)
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INT8_MAX = 127.0
# Rows whose absolute maximum is below this are scaled as if it were this (see module docstring).
MIN_ABSMAX = 1e-12
NORM_KINDS = (None, "rms", "layer")


def qmax_of(qdtype: torch.dtype) -> float:
    """The largest quantized magnitude of ``qdtype``: 448 for FP8 e4m3, 127 for INT8."""
    if qdtype == FP8_DTYPE:
        return FP8_MAX
    if qdtype == INT8_DTYPE:
        return INT8_MAX
    raise ValueError(f"quantized dtype must be one of {QUANT_DTYPES}; got {qdtype}")


def normalize_modulate_reference(
    x: torch.Tensor,
    *,
    norm: str | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    mod_scale: torch.Tensor | None = None,
    mod_shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float32 ``y`` of the module docstring before clamping, for ``x`` ``[M, K]``."""
    y = x.float()
    k = y.shape[-1]
    if norm == "layer":
        mean = y.sum(-1, keepdim=True) / k
        d = y - mean
        y = d * (1.0 / torch.sqrt(((d * d).sum(-1, keepdim=True) / k) + eps))
    elif norm == "rms":
        y = y * (1.0 / torch.sqrt(((y * y).sum(-1, keepdim=True) / k) + eps))
    elif norm is not None:
        raise ValueError(f"norm must be one of {NORM_KINDS}; got {norm!r}")
    if norm_weight is not None:
        y = y * norm_weight.float()
    if norm_bias is not None:
        y = y + norm_bias.float()
    if mod_scale is not None or mod_shift is not None:
        rows = y.shape[0]
        mod = mod_scale if mod_scale is not None else mod_shift
        groups = mod.shape[0]
        rows_per_group = rows // groups
        if mod_scale is not None:
            y = y * (1.0 + mod_scale.float().repeat_interleave(rows_per_group, dim=0))
        if mod_shift is not None:
            y = y + mod_shift.float().repeat_interleave(rows_per_group, dim=0)
    return y


def quantize_rows(y: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the rows of float32 ``y`` (``[..., K]``): ``(q, scale [..., 1] float32)``."""
    qmax = qmax_of(qdtype)
    y = y.float()
    amax = y.abs().amax(dim=-1, keepdim=True).clamp_min(MIN_ABSMAX)
    # Tensor / tensor: CUDA tensor-by-scalar division multiplies by the scalar's
    # reciprocal, which is not the correctly rounded quotient the kernels compute.
    qmax_t = torch.full_like(amax, qmax)
    scale = amax / qmax_t
    v = (y * (qmax_t / amax)).clamp(-qmax, qmax)
    if qdtype == INT8_DTYPE:
        q = torch.round(v).to(torch.int8)  # torch.round rounds half to even
    else:
        q = v.to(FP8_DTYPE)
    return q, scale


def quantize_per_token_reference(
    x: torch.Tensor,
    qdtype: torch.dtype,
    *,
    norm: str | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    mod_scale: torch.Tensor | None = None,
    mod_shift: torch.Tensor | None = None,
    clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`omni_kernels.quant.quantize_per_token` on ``x`` ``[M, K]``.

    Returns ``(q [M, K] qdtype, scale [M, 1] float32)``; see the module docstring.
    """
    y = normalize_modulate_reference(
        x, norm=norm, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps,
        mod_scale=mod_scale, mod_shift=mod_shift,
    )
    if clamp is not None:
        y = y.clamp(-clamp, clamp)
    return quantize_rows(y, qdtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in float32 (``scale`` broadcasts: ``[M, 1]`` per row, ``[N, 1]`` per channel)."""
    return q.float() * scale.float()


def quantize_weight_reference(
    weight: torch.Tensor, qdtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel quantization of ``weight`` ``[N, K]``: ``(q [N, K], scale [N] float32)``."""
    q, scale = quantize_rows(weight.float(), qdtype)
    return q, scale.reshape(-1)


def scaled_linear_reference(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """W8A8: ``(x_q * x_scale) @ (w_q * w_scale)^T + bias`` in float32, rounded to ``out_dtype``.

    ``x_q`` ``[M, K]`` and ``w_q`` ``[N, K]`` FP8/INT8; ``x_scale`` ``[M, 1]``,
    ``w_scale`` ``[N]`` float32; ``bias`` ``[N]`` or ``None``.
    """
    out = dequantize(x_q, x_scale.reshape(-1, 1)) @ dequantize(w_q, w_scale.reshape(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def weight_only_linear_reference(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Weight-only: ``x @ (w_q * w_scale)^T + bias`` in float32, rounded to ``x.dtype``."""
    out = x.float() @ dequantize(w_q, w_scale.reshape(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


#: activations :func:`quantize_activated_reference` (and the fused kernel) apply before quantizing
INPUT_ACTIVATIONS = ("gelu_tanh",)


def activate_reference(x: torch.Tensor, activation: str, activation_from: int = 0) -> torch.Tensor:
    """float32 ``y``: ``x [M, K]`` with ``activation`` applied to columns ``activation_from:``.

    ``"gelu_tanh"`` is ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (``F.gelu(x,
    approximate="tanh")``); the columns before ``activation_from`` pass through (Flux's
    single blocks feed ``proj_out`` with ``cat(attention output, GELU(mlp))``).
    """
    if activation not in INPUT_ACTIVATIONS:
        raise ValueError(f"activation must be one of {INPUT_ACTIVATIONS}; got {activation!r}")
    y = x.float()
    if activation_from == 0:
        return torch.nn.functional.gelu(y, approximate="tanh")
    return torch.cat([y[:, :activation_from], torch.nn.functional.gelu(y[:, activation_from:], approximate="tanh")],
                     dim=1)


def quantize_activated_reference(
    x: torch.Tensor,
    qdtype: torch.dtype,
    activation: str = "gelu_tanh",
    activation_from: int = 0,
    clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`omni_kernels.quant.quantize_activated_per_token` on ``x`` ``[M, K]``:
    :func:`activate_reference`, then ``clamp``, then :func:`quantize_rows` (all float32)."""
    y = activate_reference(x, activation, activation_from)
    if clamp is not None:
        y = y.clamp(-clamp, clamp)
    return quantize_rows(y, qdtype)
