"""Loading of the compiled extension ``omni_kernels._C``.

The package works without it (Triton and PyTorch paths); only the ops that are
compiled C++/CUDA need it, and they call :func:`require_compiled_extension`,
which explains what is missing and how to build it.
"""

from __future__ import annotations

import importlib

BUILD_HINT = (
    "Build it from a source checkout with a CUDA toolkit (nvcc >= 12.0) and a CUDA build of "
    "torch: `CUDA_HOME=/usr/local/cuda pip install --no-build-isolation -e .` "
    "(or `make build`); see README.md."
)


def _load_compiled_extension() -> str | None:
    try:
        importlib.import_module("omni_kernels._C")
    except ImportError as exc:
        return f"omni_kernels._C is not available ({exc}). {BUILD_HINT}"
    return None


# Resolved once, at import: the checks below then read a constant, which torch.compile traces
# without a graph break (it cannot trace the import machinery).
_COMPILED_EXTENSION_ERROR = _load_compiled_extension()


def compiled_extension_error() -> str | None:
    """Why ``omni_kernels._C`` cannot be used, or ``None`` when it loaded."""
    return _COMPILED_EXTENSION_ERROR


def has_compiled_extension() -> bool:
    """True when ``omni_kernels._C`` is built and loads (its ops are registered)."""
    return compiled_extension_error() is None


def require_compiled_extension(what: str) -> None:
    """Raise ``RuntimeError`` naming ``what`` needed the missing extension."""
    error = compiled_extension_error()
    if error is not None:
        raise RuntimeError(f"{what} needs the compiled extension: {error}")
