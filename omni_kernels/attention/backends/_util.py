"""Helpers shared by the backends: composable availability requirements, input checks."""

from __future__ import annotations

from collections.abc import Callable

import torch

from omni_kernels._packages import OptionalPackage

#: ``(device or None) -> None | reason``: what a backend's ``availability`` is.
Requirement = Callable[[torch.device | None], "str | None"]


def all_of(*requirements: Requirement) -> Requirement:
    """A requirement met when every one of ``requirements`` is; the first reason otherwise."""

    def check(device: torch.device | None) -> str | None:
        for requirement in requirements:
            reason = requirement(device)
            if reason is not None:
                return reason
        return None

    return check


def has_symbols(package: OptionalPackage, *symbols: str) -> Requirement:
    """The requirement that ``package`` imports and has ``symbols`` (whatever the device)."""
    return lambda device: package.missing_reason(*symbols)


def cuda_reason(device: torch.device | None) -> str | None:
    if device is not None and device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available (torch.cuda.is_available() is False)"
    return None


def last_dim_contiguous(q, k, v) -> str | None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            return f"needs a contiguous last dimension in {name}; got strides {tuple(t.stride())}"
    return None


def triton_input_check(problem, q, k, v, key_padding_mask) -> str | None:
    """Input check of omni's Triton backends (``omni_triton``, ``omni_sage``): a reason, or None.

    Constraints: on CPU (Triton's interpreter) no bfloat16, which the
    interpreter mishandles; on CUDA no float32 (float16/bfloat16 only); ``q``,
    ``k`` and ``v`` with stride 1 in their last (head) dimension, since the
    kernels take only batch/head/sequence strides. ``problem`` is the registry's
    :class:`~omni_kernels.attention.spec.AttentionProblem`; ``key_padding_mask``
    is unused (both backends declare ``key_padding_mask=False``).
    """
    if problem.device.type == "cpu" and problem.dtype == torch.bfloat16:
        return "cannot take dtype=bfloat16 on CPU: Triton's interpreter mishandles bfloat16"
    if problem.device.type == "cuda" and problem.dtype == torch.float32:
        return "cannot take dtype=float32 on CUDA: float16/bfloat16 (float32 only under the interpreter)"
    return last_dim_contiguous(q, k, v)
