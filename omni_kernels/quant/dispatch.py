"""Argument checks and backend choice for :func:`quantize_per_token`.

Each compiled backend is a ``torch.library`` op returning ``(q, scale)``:

* ``torch.ops.omni_kernels.quantize_per_token`` — CUDA C++ (``csrc/quant``);
  its fake implementation is registered here, its schema in ``csrc/torch_bindings.cpp``.
* ``torch.ops.omni_kernels.quantize_per_token_triton`` — the Triton kernel.

so ``torch.compile(fullgraph=True)`` traces through :func:`quantize_per_token`. Eager calls on
plain tensors run the Triton op's body (its launcher) without the custom-op dispatch
(:func:`omni_kernels._triton.eager_launch_allowed`).
"""

from __future__ import annotations

import logging
import math

import torch

from omni_kernels._backend_choice import choose_backend
from omni_kernels._device import cuda_capability, cuda_index, known_cuda_capability
from omni_kernels._extension import compiled_extension_error, has_compiled_extension
from omni_kernels._triton import eager_launch_allowed, launch_eagerly, triton_interpreter_enabled, triton_unavailable_reason
from omni_kernels.quant.reference import (
    FP8_DTYPE,
    INT8_DTYPE,
    NORM_KINDS,
    QUANT_DTYPES,
    quantize_per_token_reference,
)

logger = logging.getLogger(__name__)

QUANTIZE_BACKENDS = ("auto", "cuda", "triton", "torch")
# Norm- or modulation-fused rows (the CUDA op's register kernel): CUDA first for short inputs
# in eager mode (there the Triton op's Python dispatch costs more than its kernel), Triton from
# _TRITON_FIRST_ROWS rows or _TRITON_FIRST_ELEMENTS values (the crossover lies between the
# measured sizes), and under torch.compile (Inductor launches the triton_op from its own code).
# Plain rows (no norm, no modulation) of at most CUDA_STAGED_MAX_ROW values go to the CUDA
# op's shared-memory-staged kernel (csrc/quant/quant_staged_kernel.cuh): CUDA first everywhere
# (as fast as the Triton kernel or faster, with a C++ op's dispatch instead of a Triton
# launch's Python). Measurements: bench/results/INDEX.md.
_AUTO_ORDER = ("cuda", "triton", "torch")
_AUTO_ORDER_MANY_ROWS = ("triton", "cuda", "torch")
_TRITON_FIRST_ROWS = 32768
_TRITON_FIRST_ELEMENTS = 1 << 25
# Widest row (16-bit values) the CUDA op stages in shared memory: 48 KB (csrc/quant/quant_params.h).
CUDA_STAGED_MAX_ROW = 24576


def auto_order(rows: int, k: int = 0, fused: bool = True) -> tuple[str, ...]:
    """The backends ``backend="auto"`` tries, in order, for an input of ``rows`` tokens of ``k``
    values; ``fused``: with a norm or an adaLN modulation.

    Plain rows that fit the CUDA op's shared-memory-staged kernel take CUDA first; fused rows
    take CUDA first only for short inputs in eager mode (see the measurements above)."""
    if not fused and 0 < k <= CUDA_STAGED_MAX_ROW:
        return _AUTO_ORDER
    if rows >= _TRITON_FIRST_ROWS or rows * k >= _TRITON_FIRST_ELEMENTS or torch.compiler.is_compiling():
        return _AUTO_ORDER_MANY_ROWS
    return _AUTO_ORDER
_NORM_CODES = {None: 0, "rms": 1, "layer": 2}
CUDA_DTYPES = (torch.float16, torch.bfloat16)
# The CUDA kernel moves 16 bytes per thread and vector: 8 half-precision elements, and keeps a
# row of up to 512 threads x 8 vectors x 8 elements in registers (csrc/quant/quant_params.h).
CUDA_VECTOR_ELEMENTS = 8
CUDA_MAX_ROW = 512 * 8 * 8
# FP8 e4m3 conversions in hardware (and Triton's float8e4nv) need compute capability 8.9.
FP8_MIN_CAPABILITY = (8, 9)
_DTYPE_NAMES = {"fp8": FP8_DTYPE, "int8": INT8_DTYPE, FP8_DTYPE: FP8_DTYPE, INT8_DTYPE: INT8_DTYPE}

_logged_auto_choices: set[tuple] = set()


def device_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA device, cached (queried once per device, in eager code)."""
    return cuda_capability(cuda_index(device))


def cached_device_capability(device: torch.device) -> tuple[int, int] | None:
    """The capability :func:`device_capability` cached for ``device``, without querying the GPU
    (safe while ``torch.compile`` traces); ``None`` if no eager call has asked yet."""
    return known_cuda_capability(cuda_index(device))


def fp8_unsupported_reason(device: torch.device) -> str | None:
    """Why FP8 cannot run on ``device`` (a CUDA GPU without FP8 tensor cores), else ``None``.

    CPU tensors return ``None`` (torch's CPU FP8 paths are references). While
    ``torch.compile`` traces, the check is skipped: it ran in eager code before
    (:func:`omni_diffusion.quantization.quantize` checks the model's GPU).
    """
    if device.type != "cuda" or torch.compiler.is_compiling():
        return None
    capability = device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"FP8 needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell); "
            f"{device} is {name} with capability {capability[0]}.{capability[1]}. "
            f"Use INT8 instead (method 'int8' or 'int8_weight_only')"
        )
    return None


def resolve_quant_dtype(dtype) -> torch.dtype:
    """``"fp8"``/``torch.float8_e4m3fn`` or ``"int8"``/``torch.int8`` -> the torch dtype."""
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"dtype must be 'fp8' (torch.float8_e4m3fn) or 'int8' (torch.int8); got {dtype!r}"
        ) from None


# A triton_op lets Inductor launch the kernel itself; the Triton interpreter's kernels cannot be
# traced into (they read data pointers), so under it (CPU tests) the op is an opaque custom op.
_register_triton_op = torch.library.custom_op if triton_interpreter_enabled() else torch.library.triton_op


@_register_triton_op("omni_kernels::quantize_per_token_triton", mutates_args=())
def _quantize_per_token_triton_op(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    mod_scale: torch.Tensor | None,
    mod_shift: torch.Tensor | None,
    norm: int,
    eps: float,
    clamp: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    from omni_kernels.quant.triton_kernel import launch_quantize_per_token_triton

    return launch_quantize_per_token_triton(
        x, norm_weight, norm_bias, mod_scale, mod_shift, norm, eps, clamp, out_dtype
    )


def _launch_triton(*args, **kwargs):
    """The Triton launcher itself, for eager calls (see ``eager_launch_allowed``)."""
    from omni_kernels.quant.triton_kernel import launch_quantize_per_token_triton

    return launch_eagerly(launch_quantize_per_token_triton, *args, **kwargs)


def _fake_quantize(x, norm_weight, norm_bias, mod_scale, mod_shift, norm, eps, clamp, out_dtype):
    return (
        x.new_empty(x.shape, dtype=out_dtype),
        x.new_empty((x.shape[0], 1), dtype=torch.float32),
    )


_quantize_per_token_triton_op.register_fake(_fake_quantize)


@_register_triton_op("omni_kernels::quantize_per_token_concat_triton", mutates_args=())
def _quantize_per_token_concat_triton_op(
    prefix: torch.Tensor,
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    mod_scale: torch.Tensor | None,
    mod_shift: torch.Tensor | None,
    norm: int,
    eps: float,
    clamp: float,
    out_dtype: torch.dtype,
    batch: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    from omni_kernels.quant.triton_kernel import launch_quantize_per_token_triton

    return launch_quantize_per_token_triton(
        x, norm_weight, norm_bias, mod_scale, mod_shift, norm, eps, clamp, out_dtype, prefix=prefix, batch=batch
    )


@_quantize_per_token_concat_triton_op.register_fake
def _(prefix, x, norm_weight, norm_bias, mod_scale, mod_shift, norm, eps, clamp, out_dtype, batch):
    rows = prefix.shape[0] + x.shape[0]
    return x.new_empty((rows, x.shape[1]), dtype=out_dtype), x.new_empty((rows, 1), dtype=torch.float32)

if has_compiled_extension():
    torch.library.register_fake("omni_kernels::quantize_per_token")(_fake_quantize)


def _check_arguments(x, qdtype, norm, norm_weight, norm_bias, eps, mod_scale, mod_shift, clamp):
    """Raise ``ValueError`` naming the argument, its value and what is allowed."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor [..., K]; got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in QUANT_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32; got {x.dtype}")
    if norm not in NORM_KINDS:
        raise ValueError(f"norm must be one of {NORM_KINDS}; got {norm!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0; got {eps}")
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be None or > 0; got {clamp}")
    k = x.shape[-1]
    for name, t in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if t is None:
            continue
        if t.dim() != 1 or t.numel() != k:
            raise ValueError(f"{name} must be 1-D with K={k} elements; got shape {tuple(t.shape)}")
        if t.device != x.device or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor on {x.device}; got {t.dtype} on {t.device}")
    rows = x.numel() // k if k else 0
    groups = None
    for name, t in (("mod_scale", mod_scale), ("mod_shift", mod_shift)):
        if t is None:
            continue
        if t.shape[-1] != k or t.numel() == 0:
            raise ValueError(f"{name} must be [G, K={k}] (one row per batch element); got {tuple(t.shape)}")
        g = t.numel() // k
        if rows % g:
            raise ValueError(
                f"{name} has {g} rows, which must divide the {rows} rows of x (x rows are grouped "
                f"in order: row r uses {name}[r // (rows / G)]); got shape {tuple(t.shape)}"
            )
        if groups is not None and g != groups:
            raise ValueError(f"mod_scale and mod_shift must have the same number of rows; got {groups} and {g}")
        groups = g
        if t.device != x.device or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor on {x.device}; got {t.dtype} on {t.device}")


def _cuda_ineligible_reason(x2, qdtype, operands) -> str | None:
    error = compiled_extension_error()
    if error is not None:
        return error
    if x2.device.type != "cuda":
        return f"the CUDA kernel needs CUDA tensors; got device {x2.device}"
    if x2.dtype not in CUDA_DTYPES:
        return f"the CUDA kernel takes float16 or bfloat16; got {x2.dtype}"
    k = x2.shape[1]
    if k % CUDA_VECTOR_ELEMENTS or k > CUDA_MAX_ROW:
        return (
            f"the CUDA kernel needs K a multiple of {CUDA_VECTOR_ELEMENTS} and at most "
            f"{CUDA_MAX_ROW}; got K={k}"
        )
    if x2.stride(0) % CUDA_VECTOR_ELEMENTS:
        return f"the CUDA kernel needs 16-byte aligned rows; got row stride {x2.stride(0)}"
    if not torch.compiler.is_compiling() and x2.storage_offset() % CUDA_VECTOR_ELEMENTS:
        return f"the CUDA kernel needs x to start 16-byte aligned; got storage offset {x2.storage_offset()}"
    for name, t in operands.items():
        if t is not None and t.dtype not in (x2.dtype, torch.float32):
            return f"the CUDA kernel takes {name} in {x2.dtype} or float32; got {t.dtype}"
    return None


def triton_ineligible_reason(x2: torch.Tensor, qdtype: torch.dtype) -> str | None:
    """Why omni's Triton quantization kernels cannot quantize ``x2`` to ``qdtype`` here, else ``None``."""
    reason = triton_unavailable_reason(x2.device)
    if reason is not None:
        return f"the Triton kernel cannot run: {reason}"
    if x2.device.type == "cpu" and triton_interpreter_enabled():
        if qdtype == FP8_DTYPE:
            return "the Triton interpreter has no float8 (use backend='torch' on CPU)"
        if x2.dtype == torch.bfloat16:
            return "the Triton interpreter's bfloat16 is broken (use float16/float32 on CPU)"
    if qdtype == FP8_DTYPE:
        reason = fp8_unsupported_reason(x2.device)
        if reason is not None:
            return reason
    return None


def _ineligible_reason(backend, x2, qdtype, operands, has_prefix: bool = False) -> str | None:
    if backend == "cuda":
        if has_prefix:
            return "the CUDA kernel reads one input tensor, not a prefix and x apart (Triton or torch do)"
        return _cuda_ineligible_reason(x2, qdtype, operands)
    if backend == "triton":
        return triton_ineligible_reason(x2, qdtype)
    return None


def supported_backends(x: torch.Tensor, dtype="int8") -> dict[str, str | None]:
    """For each concrete backend, ``None`` if it can quantize ``x`` to ``dtype``, else why not."""
    qdtype = resolve_quant_dtype(dtype)
    x2 = x.reshape(-1, x.shape[-1])
    return {b: _ineligible_reason(b, x2, qdtype, {}) for b in _AUTO_ORDER}


def _check_prefix(prefix: torch.Tensor | None, x: torch.Tensor, mod: torch.Tensor | None) -> int:
    """The batch (product of the leading dims) of ``cat([prefix, x], -2)``; ``ValueError`` naming
    what does not fit."""
    if prefix is None:
        return 1
    if not isinstance(prefix, torch.Tensor) or x.dim() < 2 or prefix.dim() != x.dim() or (
        prefix.shape[:-2] != x.shape[:-2] or prefix.shape[-1] != x.shape[-1]
    ):
        raise ValueError(
            f"prefix must be [..., P, K] with x [..., S, K] (same leading dims and K); got prefix "
            f"{tuple(prefix.shape) if isinstance(prefix, torch.Tensor) else type(prefix).__name__} and x {tuple(x.shape)}"
        )
    if prefix.dtype != x.dtype or prefix.device != x.device:
        raise ValueError(f"prefix must be {x.dtype} on {x.device} like x; got {prefix.dtype} on {prefix.device}")
    batch = math.prod(x.shape[:-2])
    if mod is not None and batch % max(1, mod.numel() // max(1, x.shape[-1])):
        raise ValueError(
            f"with a prefix the modulation tables' rows must divide the batch {batch} (whole samples a "
            f"table); got {mod.numel() // x.shape[-1]} rows"
        )
    return batch


def _as_table(t: torch.Tensor | None, k: int) -> torch.Tensor | None:
    # [B, K], [B, 1, K] (Wan), [K] -> [G, K] contiguous (small: one row per batch element).
    return None if t is None else t.reshape(-1, k).contiguous()


def quantize_per_token(
    x: torch.Tensor,
    dtype="fp8",
    *,
    norm: str | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    mod_scale: torch.Tensor | None = None,
    mod_shift: torch.Tensor | None = None,
    clamp: float | None = None,
    backend: str = "auto",
    prefix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row (token) of ``x`` to FP8 e4m3 or INT8 with its own scale.

    Optionally normalizes and modulates first, in the same pass (the adaLN
    pattern before a DiT linear layer: ``LayerNorm(x) * (1 + scale) + shift``);
    see :mod:`omni_kernels.quant.reference` for the exact definition.

    Args:
        x: ``[..., K]`` float16/bfloat16/float32; the rows are the leading dims.
        dtype: ``"fp8"`` (``torch.float8_e4m3fn``) or ``"int8"`` (``torch.int8``).
        norm: ``None``, ``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm) over K.
        norm_weight, norm_bias: optional ``[K]`` affine of the norm (any float dtype).
        eps: the norm's epsilon.
        mod_scale, mod_shift: optional adaLN modulation, ``[G, K]`` (or
            ``[G, 1, K]``, ``[K]``): ``y * (1 + mod_scale) + mod_shift``, where the
            rows of ``x`` are split into G equal consecutive groups (G = batch).
        clamp: clip ``y`` to ``[-clamp, clamp]`` before the absolute maximum.
        backend: ``"auto"``, ``"cuda"``, ``"triton"`` or ``"torch"``.
        prefix: ``None``, or ``[..., P, K]`` with ``x`` ``[..., S, K]`` (same leading dims, dtype
            and device): the input is then ``cat([prefix, x], dim=-2)`` (a joint text + image
            sequence kept as two tensors), read in place by the Triton kernel (the CUDA one
            cannot; the torch backend concatenates). The modulation tables' G must divide the
            batch (the leading dims' product): groups of whole samples.

    Returns:
        ``(q, scale)``: ``q`` of ``x``'s shape in the quantized dtype, ``scale``
        ``[..., 1]`` float32, so that ``x ~= q * scale`` (after the norm/modulation).

    Raises:
        ValueError: a bad argument, an unknown backend, or a requested backend
            that cannot take these inputs (the message names the constraint).
    """
    if backend not in QUANTIZE_BACKENDS:
        raise ValueError(f"backend must be one of {QUANTIZE_BACKENDS}; got {backend!r}")
    qdtype = resolve_quant_dtype(dtype)
    _check_arguments(x, qdtype, norm, norm_weight, norm_bias, eps, mod_scale, mod_shift, clamp)
    batch = _check_prefix(prefix, x, mod_scale if mod_scale is not None else mod_shift)
    lead, k = x.shape[:-1], x.shape[-1]
    if prefix is not None:
        lead = (*x.shape[:-2], prefix.shape[-2] + x.shape[-2])
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # (a reshape is a dispatched call even when a no-op)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    mod_scale = _as_table(mod_scale, k)
    mod_shift = _as_table(mod_shift, k)
    norm_weight = norm_weight.contiguous() if norm_weight is not None else None
    norm_bias = norm_bias.contiguous() if norm_bias is not None else None
    operands = dict(norm_weight=norm_weight, norm_bias=norm_bias, mod_scale=mod_scale, mod_shift=mod_shift)

    fused = norm is not None or any(t is not None for t in operands.values())
    order = auto_order(x2.shape[0], k, fused)
    backend = choose_backend(
        "quantize_per_token", backend, order,
        lambda name: _ineligible_reason(name, x2, qdtype, operands, prefix is not None),
        log_key=(x.device.type, x.dtype, qdtype, order[0], prefix is not None),
        describe=lambda: f"{x.device.type} {x.dtype} -> {qdtype}{' with a prefix' if prefix is not None else ''}",
        logged=_logged_auto_choices, logger=logger,
    )

    if prefix is not None:
        if backend == "torch":
            joint = torch.cat([prefix, x], dim=-2).reshape(-1, k)
            q, scale = quantize_per_token_reference(
                joint, qdtype, norm=norm, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps,
                mod_scale=mod_scale, mod_shift=mod_shift, clamp=clamp,
            )
        else:
            prefix2 = prefix.reshape(-1, k)
            if prefix2.stride(-1) != 1:
                prefix2 = prefix2.contiguous()
            args = (x2, norm_weight, norm_bias, mod_scale, mod_shift, _NORM_CODES[norm], float(eps),
                    float(clamp) if clamp is not None else 0.0, qdtype)
            if eager_launch_allowed(prefix2, x2, norm_weight, norm_bias, mod_scale, mod_shift):
                q, scale = _launch_triton(*args, prefix=prefix2, batch=batch)
            else:
                q, scale = torch.ops.omni_kernels.quantize_per_token_concat_triton(prefix2, *args, batch)
    elif backend == "torch":
        q, scale = quantize_per_token_reference(
            x2, qdtype, norm=norm, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps,
            mod_scale=mod_scale, mod_shift=mod_shift, clamp=clamp,
        )
    else:
        args = (x2, norm_weight, norm_bias, mod_scale, mod_shift, _NORM_CODES[norm], float(eps),
                float(clamp) if clamp is not None else 0.0, qdtype)
        if backend == "cuda":
            q, scale = torch.ops.omni_kernels.quantize_per_token(*args)
        elif eager_launch_allowed(x2, norm_weight, norm_bias, mod_scale, mod_shift):
            q, scale = _launch_triton(*args)
        else:
            q, scale = torch.ops.omni_kernels.quantize_per_token_triton(*args)
    if x.dim() == 2 and prefix is None:  # the ops return [M, K] and [M, 1] already
        return q, scale
    return q.reshape(*lead, k), scale.reshape(*lead, 1)
