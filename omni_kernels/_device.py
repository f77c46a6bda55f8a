"""CUDA device facts asked on every eager call, cached: index and compute capability."""

from __future__ import annotations

import functools

import torch


def cuda_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device when it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def cuda_capability(index: int) -> tuple[int, int]:
    """CUDA device ``index``'s compute capability, cached (asked on every eager call)."""
    return tuple(torch.cuda.get_device_capability(index))


__all__ = ["cuda_capability", "cuda_index"]
