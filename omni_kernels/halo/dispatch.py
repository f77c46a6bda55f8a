"""Argument checks and backend choice for :func:`halo_pack` and :func:`halo_assemble`.

Backends are ``torch.library`` ops that write into preallocated tensors:

* ``torch.ops.omni_kernels.halo_pack`` / ``halo_assemble``: CUDA C++ (``csrc/halo``), schemas in
  ``csrc/torch_bindings.cpp``, fake implementations here;
* ``torch.ops.omni_kernels.halo_pack_triton`` / ``halo_assemble_triton``: the Triton kernels;
* ``"torch"``: :mod:`omni_kernels.halo.reference` (slice copies).
"""

from __future__ import annotations

import logging

import torch

from omni_kernels._backend_choice import choose_backend
from omni_kernels._extension import compiled_extension_error
from omni_kernels._triton import triton_unavailable_reason
from omni_kernels.halo.reference import (
    HALO_MODES,
    HALO_RECV,
    halo_assemble_reference,
    halo_pack_reference,
)

logger = logging.getLogger(__name__)

HALO_BACKENDS = ("auto", "cuda", "triton", "torch")
# Not yet measured against each other (bench/halo.py records it); CUDA first as the compiled,
# launch-cheapest path, the reference last because it takes anything.
_AUTO_ORDER = ("cuda", "triton", "torch")
_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_logged_auto_choices: set[tuple] = set()


@torch.library.custom_op(
    "omni_kernels::halo_pack_triton", mutates_args=("send_lo", "send_hi"), device_types=None
)
def _halo_pack_triton_op(x: torch.Tensor, send_lo: torch.Tensor, send_hi: torch.Tensor) -> None:
    from omni_kernels.halo.triton_kernel import launch_halo_pack_triton

    launch_halo_pack_triton(x, send_lo, send_hi)


@_halo_pack_triton_op.register_fake
def _(x, send_lo, send_hi):
    return None


@torch.library.custom_op(
    "omni_kernels::halo_assemble_triton", mutates_args=("out",), device_types=None
)
def _halo_assemble_triton_op(
    x: torch.Tensor,
    recv_lo: torch.Tensor | None,
    recv_hi: torch.Tensor | None,
    out: torch.Tensor,
    lo_rows: int,
    hi_rows: int,
    lo_mode: int,
    hi_mode: int,
) -> None:
    from omni_kernels.halo.triton_kernel import launch_halo_assemble_triton

    launch_halo_assemble_triton(x, recv_lo, recv_hi, out, lo_rows, hi_rows, lo_mode, hi_mode)


@_halo_assemble_triton_op.register_fake
def _(x, recv_lo, recv_hi, out, lo_rows, hi_rows, lo_mode, hi_mode):
    return None


def _cuda_ops_present() -> bool:
    return compiled_extension_error() is None and hasattr(torch.ops.omni_kernels, "halo_pack")


if _cuda_ops_present():

    @torch.library.register_fake("omni_kernels::halo_pack")
    def _(x, send_lo, send_hi):
        return None

    @torch.library.register_fake("omni_kernels::halo_assemble")
    def _(x, recv_lo, recv_hi, out, lo_rows, hi_rows, lo_mode, hi_mode):
        return None


def _ineligible_reason(backend: str, x: torch.Tensor) -> str | None:
    if backend == "cuda":
        error = compiled_extension_error()
        if error is not None:
            return error
        if not hasattr(torch.ops.omni_kernels, "halo_pack"):
            return "omni_kernels._C predates the halo ops; rebuild it (make build)"
        if x.device.type != "cuda":
            return f"the CUDA kernel needs CUDA tensors; got device {x.device}"
        if x.dtype not in _CUDA_DTYPES:
            return f"the CUDA kernel takes float16, bfloat16 or float32; got {x.dtype}"
        return None
    if backend == "triton":
        reason = triton_unavailable_reason(x.device)
        return None if reason is None else f"the Triton kernel cannot run: {reason}"
    return None


def _choose(op_name: str, backend: str, x: torch.Tensor) -> str:
    if backend not in HALO_BACKENDS:
        raise ValueError(f"backend must be one of {HALO_BACKENDS}; got {backend!r}")
    return choose_backend(
        op_name, backend, _AUTO_ORDER, lambda name: _ineligible_reason(name, x),
        log_key=(x.device.type, x.dtype),
        describe=lambda: f"{x.device.type} {x.dtype}",
        logged=_logged_auto_choices, logger=logger,
    )


def _check_rows(name: str, t: torch.Tensor, x: torch.Tensor, rows: int, contiguous: bool) -> None:
    n, frames, _, w = x.shape
    if t.shape != (n, frames, rows, w) or t.dtype != x.dtype or t.device != x.device:
        raise ValueError(
            f"{name} must be [N, T, rows, W] = {[n, frames, rows, w]} {x.dtype} on {x.device}; got "
            f"{list(t.shape)} {t.dtype} on {t.device}"
        )
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is sent or received as is); got strides "
                         f"{t.stride()}")


def _check_x(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        got = f"{x.dim()}-D {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a 4-D floating-point tensor [N, T, h, W]; got {got}")


def halo_pack(
    x: torch.Tensor, send_lo: torch.Tensor, send_hi: torch.Tensor, *, backend: str = "auto"
) -> None:
    """Copy the first ``n_lo`` and last ``n_hi`` rows of ``x`` into the send buffers.

    Args:
        x: ``[N, T, h, W]`` float16/bfloat16/float32, any strides (a shard of a feature map
            viewed with batch x channels as ``N`` and frames as ``T``).
        send_lo: ``[N, T, n_lo, W]`` contiguous, same dtype/device; ``n_lo`` may be 0.
        send_hi: ``[N, T, n_hi, W]`` contiguous; ``n_hi`` may be 0. ``n_lo, n_hi <= h``.
        backend: ``"auto"``, ``"cuda"``, ``"triton"`` or ``"torch"``.
    """
    _check_x(x)
    for name, t in (("send_lo", send_lo), ("send_hi", send_hi)):
        rows = t.shape[2] if t.dim() == 4 else -1
        if not 0 <= rows <= x.shape[2]:
            raise ValueError(f"{name} must hold between 0 and h={x.shape[2]} rows; got shape "
                             f"{list(t.shape)}")
        _check_rows(name, t, x, rows, contiguous=True)
    backend = _choose("halo_pack", backend, x)
    if backend == "torch":
        halo_pack_reference(x, send_lo, send_hi)
    elif backend == "cuda":
        torch.ops.omni_kernels.halo_pack(x, send_lo, send_hi)
    else:
        torch.ops.omni_kernels.halo_pack_triton(x, send_lo, send_hi)


def halo_assemble(
    x: torch.Tensor,
    recv_lo: torch.Tensor | None,
    recv_hi: torch.Tensor | None,
    out: torch.Tensor,
    *,
    lo_rows: int,
    hi_rows: int,
    lo_mode: int,
    hi_mode: int,
    backend: str = "auto",
) -> torch.Tensor:
    """Write ``x`` and its halo rows into ``out`` in one pass (no ``torch.cat``/pad copies).

    Args:
        x: ``[N, T, h, W]`` float16/bfloat16/float32, any strides.
        recv_lo, recv_hi: ``[N, T, lo_rows, W]`` / ``[N, T, hi_rows, W]`` contiguous, the rows
            received from the neighbours; required when the side's mode is ``HALO_RECV``, else
            ignored (may be ``None``).
        out: ``[N, T, lo_rows + h + hi_rows, W]``, any strides (normally a view into a
            persistent pre-padded buffer); must not overlap the inputs.
        lo_mode, hi_mode: ``HALO_RECV``, ``HALO_ZERO`` or ``HALO_REPLICATE`` (0, 1, 2) for the
            rows above / below ``x``.
        backend: ``"auto"``, ``"cuda"``, ``"triton"`` or ``"torch"``.

    Returns:
        ``out``.
    """
    _check_x(x)
    n, frames, h, w = x.shape
    for name, value in (("lo_rows", lo_rows), ("hi_rows", hi_rows)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0; got {value!r}")
    for name, value in (("lo_mode", lo_mode), ("hi_mode", hi_mode)):
        if value not in HALO_MODES:
            raise ValueError(f"{name} must be one of {HALO_MODES} (recv, zero, replicate); got "
                             f"{value!r}")
    for name, t, rows, mode in (("recv_lo", recv_lo, lo_rows, lo_mode),
                                ("recv_hi", recv_hi, hi_rows, hi_mode)):
        if mode == HALO_RECV and rows > 0:
            if t is None:
                raise ValueError(f"{name} is required when its mode is HALO_RECV and rows > 0")
            _check_rows(name, t, x, rows, contiguous=True)
    _check_rows("out", out, x, lo_rows + h + hi_rows, contiguous=False)
    backend = _choose("halo_assemble", backend, x)
    if backend == "torch":
        halo_assemble_reference(x, recv_lo, recv_hi, out, lo_rows, hi_rows, lo_mode, hi_mode)
        return out
    # The kernels read recv_* only in HALO_RECV mode; pass None otherwise.
    recv_lo = recv_lo if lo_mode == HALO_RECV and lo_rows > 0 else None
    recv_hi = recv_hi if hi_mode == HALO_RECV and hi_rows > 0 else None
    op = (torch.ops.omni_kernels.halo_assemble if backend == "cuda"
          else torch.ops.omni_kernels.halo_assemble_triton)
    op(x, recv_lo, recv_hi, out, lo_rows, hi_rows, lo_mode, hi_mode)
    return out
