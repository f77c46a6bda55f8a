"""Per-token quantization of an activation's output, the activation fused in: :func:`quantize_activated_per_token`.

For linear layers whose input is a GELU's output (a DiT's MLP down projection,
Flux's single blocks' ``proj_out``): the pre-activation is read once, the GELU,
the per-row absolute maximum and the 8-bit values are computed in registers, and
only the 8-bit input and its scales are written. Backends:

* ``"triton"``: :mod:`.activated_triton_kernel`, through the op
  ``torch.ops.omni_kernels.quantize_activated_triton``, a ``torch.library.triton_op``:
  ``torch.compile`` traces into it and Inductor launches the Triton kernel from
  its generated code (no Python dispatch per call). With ``prefix=`` (Flux's
  ``proj_out`` input ``cat(attention output, GELU(mlp))`` read without its ``cat``),
  the op ``torch.ops.omni_kernels.quantize_activated_concat_triton``, the same kernel
  reading the prefix through its own pointer. Eager calls on plain tensors run the op's body
  (the launcher) without the custom-op dispatch (:func:`omni_kernels._triton.eager_launch_allowed`).
* ``"cuda"``: omni's CUDA C++ per-token kernel (``csrc/quant``) in its GELU instantiation,
  through the op ``torch.ops.omni_kernels.quantize_activated``: rows of up to 24576 values
  (48 KB) are staged in shared memory with asynchronous copies and the GELU is evaluated once
  a value (the row's maximum comes from its largest input), so many rows are in flight a SM
  (``csrc/quant/quant_staged_kernel.cuh``); wider rows take a kernel that holds the row in
  registers. Faster than the Triton kernel at Flux's and Wan's widths; ``"auto"``
  takes it first. Needs the compiled extension, float16/bfloat16 input, widths that are
  multiples of 8 (at most 32768 in all) and 16-byte aligned rows.
* ``"torch"``: the float32 reference (:func:`~omni_kernels.quant.reference.quantize_activated_reference`),
  plain torch ops; under ``torch.compile`` Inductor generates its own kernel for them.

``"auto"`` takes the CUDA kernel where it runs (the compiled extension, CUDA tensors it can
read), then the Triton kernel (a CUDA GPU, or the interpreter; with FP8, one with FP8 tensor
cores), else the reference; it logs its choice once.
"""

from __future__ import annotations

import logging

import torch

from omni_kernels._backend_choice import choose_backend
from omni_kernels._triton import eager_launch_allowed, launch_eagerly, triton_interpreter_enabled
from omni_kernels._extension import compiled_extension_error, has_compiled_extension
from omni_kernels.quant.dispatch import (
    CUDA_DTYPES,
    CUDA_MAX_ROW,
    CUDA_VECTOR_ELEMENTS,
    fp8_unsupported_reason,
    resolve_quant_dtype,
    triton_ineligible_reason,
)
from omni_kernels.quant.reference import FP8_DTYPE, INPUT_ACTIVATIONS, quantize_activated_reference

logger = logging.getLogger(__name__)

ACTIVATED_QUANTIZE_BACKENDS = ("auto", "cuda", "triton", "torch")
# CUDA first, also under torch.compile (an opaque op there, which costs no GPU time): its staged
# kernel is the faster one at Flux's and Wan's widths.
_AUTO_ORDER = ("cuda", "triton", "torch")
_logged_auto_choices: set[tuple] = set()


# A triton_op lets Inductor launch the kernel itself; the Triton interpreter's kernels cannot be
# traced into (they read data pointers), so under it (CPU tests) the op is an opaque custom op.
_register_op = torch.library.custom_op if triton_interpreter_enabled() else torch.library.triton_op


@_register_op("omni_kernels::quantize_activated_triton", mutates_args=())
def _quantize_activated_triton_op(
    x: torch.Tensor, activation_from: int, clamp: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    from omni_kernels.quant.activated_triton_kernel import launch_quantize_activated_triton

    return launch_quantize_activated_triton(x, activation_from, clamp, out_dtype)


@_quantize_activated_triton_op.register_fake
def _(x, activation_from, clamp, out_dtype):
    # Explicit, so shape propagation never runs the launcher (the Triton interpreter
    # reads data pointers, which fake tensors lack).
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@_register_op("omni_kernels::quantize_activated_concat_triton", mutates_args=())
def _quantize_activated_concat_triton_op(
    prefix: torch.Tensor, x: torch.Tensor, clamp: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    from omni_kernels.quant.activated_triton_kernel import launch_quantize_activated_triton

    return launch_quantize_activated_triton(x, 0, clamp, out_dtype, prefix=prefix)


@_quantize_activated_concat_triton_op.register_fake
def _(prefix, x, clamp, out_dtype):
    rows = x.shape[0]
    return (x.new_empty((rows, prefix.shape[1] + x.shape[1]), dtype=out_dtype),
            x.new_empty((rows, 1), dtype=torch.float32))


def _fake_quantize_activated(x, prefix, activation_from, clamp, out_dtype):
    width = x.shape[1] + (prefix.shape[1] if prefix is not None else 0)
    return x.new_empty((x.shape[0], width), dtype=out_dtype), x.new_empty((x.shape[0], 1), dtype=torch.float32)


if has_compiled_extension():
    torch.library.register_fake("omni_kernels::quantize_activated")(_fake_quantize_activated)


def _cuda_ineligible_reason(x2: torch.Tensor, prefix2: torch.Tensor | None, qdtype: torch.dtype) -> str | None:
    """Why the CUDA kernel cannot take ``x2`` ``[M, K]`` (and ``prefix2`` ``[M, K0]``), else ``None``."""
    error = compiled_extension_error()
    if error is not None:
        return error
    if x2.device.type != "cuda":
        return f"the CUDA kernel needs CUDA tensors; got device {x2.device}"
    if x2.dtype not in CUDA_DTYPES:
        return f"the CUDA kernel takes float16 or bfloat16; got {x2.dtype}"
    width = 0
    for name, t in (("x", x2), ("prefix", prefix2)):
        if t is None:
            continue
        width += t.shape[1]
        if t.shape[1] % CUDA_VECTOR_ELEMENTS or t.stride(0) % CUDA_VECTOR_ELEMENTS:
            return (f"the CUDA kernel needs {name}'s columns and row stride to be multiples of "
                    f"{CUDA_VECTOR_ELEMENTS}; got {t.shape[1]} columns, row stride {t.stride(0)}")
        if not torch.compiler.is_compiling() and t.storage_offset() % CUDA_VECTOR_ELEMENTS:
            return f"the CUDA kernel needs {name} to start 16-byte aligned; got storage offset {t.storage_offset()}"
    if width > CUDA_MAX_ROW:
        return f"the CUDA kernel keeps a row of at most {CUDA_MAX_ROW} values in registers; got {width}"
    if qdtype == FP8_DTYPE:
        return fp8_unsupported_reason(x2.device)
    return None


def check_prefix(prefix: torch.Tensor, x: torch.Tensor) -> None:
    """``ValueError`` unless ``prefix`` ``[..., K0]`` can go before ``x`` ``[..., K]`` in a
    ``cat(..., -1)``: a tensor with ``x``'s leading shape, dtype and device."""
    if not isinstance(prefix, torch.Tensor) or prefix.dim() < 1:
        raise ValueError(f"prefix must be None or a tensor [..., K0]; got {type(prefix).__name__}")
    if prefix.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"prefix [..., K0] must have x's leading shape {tuple(x.shape[:-1])}; got {tuple(prefix.shape)}"
        )
    if prefix.dtype != x.dtype:
        raise ValueError(f"prefix must have x's dtype {x.dtype}; got {prefix.dtype}")
    if prefix.device != x.device:
        raise ValueError(f"prefix must be on x's device {x.device}; got {prefix.device}")


def _rows_with_unit_column_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[..., W]`` as ``[rows, W]``, a view where the rows allow (any row stride)."""
    rows = t.reshape(t.shape[:-1].numel(), t.shape[-1])  # not -1: a width of 0 leaves it ambiguous
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def quantize_activated_per_token(
    x: torch.Tensor,
    dtype="fp8",
    *,
    activation: str = "gelu_tanh",
    activation_from: int = 0,
    clamp: float | None = None,
    backend: str = "auto",
    prefix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply ``activation`` to the columns ``activation_from:`` of ``x``, then quantize each row
    (of ``cat([prefix, activated(x)], -1)`` when a ``prefix`` is given).

    Args:
        x: ``[..., K]`` float16/bfloat16/float32, the activation's input (for
            ``activation_from > 0``, the first ``activation_from`` columns are
            taken as they are: e.g. the attention output that Flux's single
            blocks concatenate before the GELU's output).
        dtype: ``"fp8"`` (``torch.float8_e4m3fn``) or ``"int8"``.
        activation: one of :data:`~omni_kernels.quant.reference.INPUT_ACTIVATIONS`
            (``"gelu_tanh"``: ``F.gelu(x, approximate="tanh")``).
        activation_from: first activated column, ``0 <= activation_from < K``.
        clamp: clip the activated row to ``[-clamp, clamp]`` before its absolute maximum.
        backend: ``"auto"``, ``"cuda"``, ``"triton"`` or ``"torch"``.
        prefix: ``None``, or ``[..., K0]`` with ``x``'s leading shape, dtype and device:
            columns taken as they are and placed before ``x``'s, without materializing the
            ``cat`` (Flux's single blocks: the attention output before ``GELU(proj_mlp(h))``).
            The activation then applies to all of ``x`` (``activation_from`` must be 0). The
            result is that of ``x = cat([prefix, x], -1)`` with ``activation_from = K0``: bit for
            bit with ``"torch"`` (which materializes the ``cat``: it is the float32 reference),
            and with ``"cuda"`` and ``"triton"`` each kernel's own values. Rows of either may have any stride
            (a column slice of a wider tensor is read in place) as long as columns are contiguous.

    Returns:
        ``(q, scale)``: ``q`` ``[..., K0 + K]`` (``K0 = 0`` without a prefix) in the quantized
        dtype and ``scale`` ``[..., 1]`` float32, with ``cat(prefix, activated(x)) ~= q * scale``.

    Raises:
        ValueError: a bad argument or a backend that cannot take the inputs (named).
    """
    if backend not in ACTIVATED_QUANTIZE_BACKENDS:
        raise ValueError(f"backend must be one of {ACTIVATED_QUANTIZE_BACKENDS}; got {backend!r}")
    qdtype = resolve_quant_dtype(dtype)
    if activation not in INPUT_ACTIVATIONS:
        raise ValueError(f"activation must be one of {INPUT_ACTIVATIONS}; got {activation!r}")
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor [..., K]; got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in (FP8_DTYPE, torch.int8):
        raise ValueError(f"x must be float16, bfloat16 or float32; got {x.dtype}")
    k = x.shape[-1]
    if isinstance(activation_from, bool) or not isinstance(activation_from, int) or not 0 <= activation_from < max(k, 1):
        raise ValueError(f"activation_from must be an int in [0, K={k}); got {activation_from!r}")
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be None or > 0; got {clamp}")
    if prefix is not None:
        check_prefix(prefix, x)
        if activation_from != 0:
            raise ValueError(
                f"activation_from must be 0 with a prefix (the activation applies to all of x); "
                f"got {activation_from}"
            )
    lead = x.shape[:-1]
    x2 = _rows_with_unit_column_stride(x)
    prefix2 = _rows_with_unit_column_stride(prefix) if prefix is not None else None
    width = k + (prefix.shape[-1] if prefix is not None else 0)
    backend = choose_backend(
        "quantize_activated_per_token", backend, _AUTO_ORDER,
        lambda name: (triton_ineligible_reason(x2, qdtype) if name == "triton"
                      else _cuda_ineligible_reason(x2, prefix2, qdtype) if name == "cuda" else None),
        log_key=(x.device.type, x.dtype, qdtype),
        describe=lambda: f"{x.device.type} {x.dtype} -> {qdtype}",
        logged=_logged_auto_choices, logger=logger,
    )
    clamp_arg = float(clamp) if clamp is not None else 0.0
    if backend == "torch":
        if prefix2 is not None:
            x2, activation_from = torch.cat([prefix2, x2], -1), prefix2.shape[-1]
        q, scale = quantize_activated_reference(x2, qdtype, activation, activation_from, clamp)
    elif backend == "cuda":
        q, scale = torch.ops.omni_kernels.quantize_activated(x2, prefix2, activation_from, clamp_arg, qdtype)
    elif eager_launch_allowed(x2, prefix2):  # the launcher itself: the op adds only dispatch here
        from omni_kernels.quant.activated_triton_kernel import launch_quantize_activated_triton

        q, scale = launch_eagerly(launch_quantize_activated_triton, x2, activation_from, clamp_arg, qdtype,
                                  prefix=prefix2)
    elif prefix2 is not None:
        q, scale = torch.ops.omni_kernels.quantize_activated_concat_triton(prefix2, x2, clamp_arg, qdtype)
    else:
        q, scale = torch.ops.omni_kernels.quantize_activated_triton(x2, activation_from, clamp_arg, qdtype)
    if x.dim() == 2:  # (a reshape is a dispatched call even when a no-op)
        return q, scale
    return q.reshape(*lead, width), scale.reshape(*lead, 1)
