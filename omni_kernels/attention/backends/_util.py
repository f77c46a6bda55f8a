"""Helpers shared by the third-party backends: lazy imports with a reason when they fail."""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

import torch

_IMPORTS: dict[str, tuple[ModuleType | None, str | None]] = {}


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def lazy_import(module: str, dist: str, hint: str) -> tuple[ModuleType | None, str | None]:
    """``(module, None)``, or ``(None, reason)``: not installed, or failed to load
    (e.g. a compiled extension built for another torch / CUDA). Cached."""
    cached = _IMPORTS.get(module)
    if cached is not None:
        return cached
    try:
        mod = importlib.import_module(module)
        result = (mod, None)
    except ModuleNotFoundError as exc:
        if exc.name and module.split(".")[0] == exc.name.split(".")[0]:
            reason = f"the {dist!r} package is not installed ({hint})"
        else:
            reason = _load_failure(module, dist, exc)
        result = (None, reason)
    except Exception as exc:  # ImportError (undefined symbol), OSError, RuntimeError, ...
        result = (None, _load_failure(module, dist, exc))
    _IMPORTS[module] = result
    return result


def _load_failure(module: str, dist: str, exc: BaseException) -> str:
    version = package_version(dist)
    installed = f"{dist} {version}" if version else dist
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return (
        f"{installed} is installed but {module!r} failed to load ({type(exc).__name__}: "
        f"{message[:300]}); it may be built for another torch/CUDA than torch "
        f"{torch.__version__} (CUDA {torch.version.cuda})"
    )


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
