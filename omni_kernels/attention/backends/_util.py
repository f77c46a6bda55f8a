"""Helpers shared by the backends: lazy imports with a reason when they fail, input checks."""

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
