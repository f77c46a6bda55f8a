"""CUDA device facts asked on every eager call, cached: index and compute capability."""

from __future__ import annotations

import torch

_capabilities: dict[int, tuple[int, int]] = {}


def cuda_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device when it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def cuda_capability(index: int) -> tuple[int, int]:
    """CUDA device ``index``'s compute capability, cached (asked on every eager call)."""
    capability = _capabilities.get(index)
    if capability is None:
        capability = _capabilities[index] = tuple(torch.cuda.get_device_capability(index))
    return capability


def known_cuda_capability(index: int) -> tuple[int, int] | None:
    """What :func:`cuda_capability` cached for device ``index``, without asking the GPU (safe
    while ``torch.compile`` traces); ``None`` if no eager call has asked yet."""
    return _capabilities.get(index)


__all__ = ["cuda_capability", "cuda_index", "known_cuda_capability"]
