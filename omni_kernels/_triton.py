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


def cdiv(a: int, b: int) -> int:
    """Ceiling division of Python ints, for host code (grids, block counts).

    Not ``triton.cdiv``: that is a ``@triton.jit`` function, and called from Python it goes
    through the JIT's argument handling, far slower than this.
    """
    return -(-a // b)


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


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def eager_launch_allowed(*tensors: torch.Tensor | None) -> bool:
    """True when a Triton op's Python launcher may run directly instead of through its
    ``torch.library`` op: eager mode (not under ``torch.compile``), no dispatch mode active
    (``make_fx``, ``FakeTensorMode``, ...) and every tensor a plain ``torch.Tensor`` (or
    ``nn.Parameter``). There the op adds only its dispatch, which can cost more host time than
    the kernel it launches takes on the GPU; everywhere else the op is what tracing and fake
    tensors need."""
    if torch.compiler.is_compiling() or _current_dispatch_mode() is not None:
        return False
    return all(t is None or type(t) in _PLAIN_TENSOR_TYPES for t in tensors)


def _current_dispatch_mode():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def launch_eagerly(launch, *args, **kwargs):
    """Call a launcher whose kernels go through ``torch.library.wrap_triton`` as the op would in
    eager mode: with wrap_triton's higher-order-op dispatch off (it exists for tracing, and in
    eager mode costs far more than the launch itself), so the kernel launches straight away."""
    from torch._library.triton import set_wrap_triton_enabled

    with set_wrap_triton_enabled(False):
        return launch(*args, **kwargs)
