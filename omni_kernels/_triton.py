"""Whether Triton kernels can run, and why not.

Triton runs on CUDA tensors, or on CPU tensors under its interpreter
(``TRITON_INTERPRET=1``, set before ``triton`` is imported), which is how CI
checks the kernels without a GPU (float16/float32 only: the interpreter's
bfloat16 is broken).
"""

from __future__ import annotations

import importlib.util
import os

import torch

# Both are read once, at import: Triton itself reads TRITON_INTERPRET when its kernels are
# defined, and torch.compile traces constants where it cannot trace importlib or os.environ.
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_TRITON_IMPORT_ERROR = (
    None
    if importlib.util.find_spec("triton") is not None
    else "the 'triton' package is not installed (pip install triton)"
)


def triton_interpreter_enabled() -> bool:
    """True when Triton kernels run through the interpreter (TRITON_INTERPRET=1 at import)."""
    return _TRITON_INTERPRET


def _triton_import_error() -> str | None:
    return _TRITON_IMPORT_ERROR


def triton_unavailable_reason(device: torch.device) -> str | None:
    """``None`` if a Triton kernel can run on tensors on ``device``, else why not."""
    error = _triton_import_error()
    if error is not None:
        return error
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_interpreter_enabled():
        return None
    return (
        f"Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1); "
        f"got device {device}"
    )
