"""The registered attention backends: register, unregister, get, list, status.

Each built-in backend module in :mod:`omni_kernels.attention.backends` registers its
:class:`~omni_kernels.attention.spec.BackendSpec` when imported; the package
:mod:`omni_kernels.attention` imports them all. This module imports no backend.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_kernels.attention.spec import LAYOUTS, BackendSpec, _arch_of

AUTO = "auto"

_REGISTRY: dict[str, BackendSpec] = {}
# Bumped by every (un)registration: caches derived from the registry compare it.
_GENERATION = [0]


def register_backend(spec: BackendSpec, *, replace: bool = False) -> BackendSpec:
    """Add ``spec`` to the registry (``replace=True`` to overwrite a name)."""
    name = spec.name
    if name == AUTO or not name or name != name.lower():
        raise ValueError(f"backend names are lower-case and not {AUTO!r}; got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"attention backend {name!r} is already registered")
    for layout in spec.layouts:
        if layout not in LAYOUTS:
            raise ValueError(f"backend {name!r}: layout {layout!r} is not one of {LAYOUTS}")
    _REGISTRY[name] = spec
    _GENERATION[0] += 1
    return spec


def unregister_backend(name: str) -> None:
    """Remove a registered backend (for tests and plug-ins)."""
    _REGISTRY.pop(name, None)
    _GENERATION[0] += 1



def list_backends() -> list[str]:
    """Registered backend names, in registration order (``"auto"`` not included)."""
    return list(_REGISTRY)


def get_backend(name: str) -> BackendSpec:
    """The spec of a registered backend; ``ValueError`` listing the names otherwise."""
    key = _normalize_name(name)
    if key == AUTO:
        raise ValueError("'auto' is a policy, not a backend; pass a backend name")
    return _REGISTRY[key]


def _normalize_name(name: Any, source: str = "argument") -> str:
    if not isinstance(name, str):
        raise ValueError(f"attention backend must be a string; got {type(name).__name__} ({source})")
    key = name.strip().lower()
    if key != AUTO and key not in _REGISTRY:
        names = ", ".join([AUTO, *_REGISTRY])
        where = "" if source == "argument" else f" (from {source})"
        raise ValueError(f"unknown attention backend {name!r}{where}; choose one of: {names}")
    return key


def backend_status(device: torch.device | str | None = None) -> dict[str, str | None]:
    """For each registered backend: ``None`` if it can run here, else why not.

    ``device`` defaults to the current CUDA device when there is one, else CPU.
    """
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    status = {}
    for name, spec in _REGISTRY.items():
        reason = spec.unavailable_reason(device)
        if reason is None and device.type == "cuda":
            _, cap = _arch_of(device)
            if spec.min_capability is not None and cap < spec.min_capability:
                reason = f"needs compute capability >= {spec.min_capability}, GPU has {cap}"
            elif spec.max_capability is not None and cap > spec.max_capability:
                reason = f"needs compute capability <= {spec.max_capability}, GPU has {cap}"
        status[name] = reason
    return status


def generation() -> int:
    """A number that changes with every registration or unregistration."""
    return _GENERATION[0]
