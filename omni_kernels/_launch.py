"""Programmatic dependent launch (PDL) between omni's back-to-back kernels.

On Hopper and later, a kernel launched with PDL may start while the kernel before it in the
stream is still running: its CTAs do their set-up and then wait (``griddepcontrol.wait``) for
the previous grid's completion and memory flush before reading what it wrote. The quantized
attention uses it for its chain ``K mean -> Q/K/V codes -> attention``: the codes kernel's Q
programs run beside the K-mean kernel instead of after it, and each launch's start-up hides
behind the previous kernel's last wave.

``OMNI_PDL=0`` turns it off (read once, at import), e.g. to time the chain without it.
"""

from __future__ import annotations

import os

import torch

from omni_kernels._device import cuda_capability, cuda_index
from omni_kernels._triton import triton_interpreter_enabled

try:  # Triton's grid dependency control (3.3 and later), for the Triton kernels of the chain
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # a Triton without it: PDL stays off (see below); never called then
    import triton

    _HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

ENV_PDL = "OMNI_PDL"
_PDL_VALUES = ("0", "1")


def _pdl_from_environment() -> bool:
    value = os.environ.get(ENV_PDL, "1").strip()
    if value not in _PDL_VALUES:
        raise ValueError(f"{ENV_PDL} must be one of {_PDL_VALUES} (0: no programmatic dependent "
                         f"launch); got {value!r}")
    return value == "1"


_PDL_ALLOWED = _pdl_from_environment()


def programmatic_launch_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: a CUDA device of compute capability >= 9.0
    (``griddepcontrol`` is sm_90 PTX), compiled Triton (not the interpreter) with grid dependency
    control (``triton.language.extra.cuda.gdc_wait``), and ``OMNI_PDL`` not 0.

    Kernels in the chain guard ``gdc_wait()`` / ``gdc_launch_dependents()`` behind a constexpr
    set from this, so they compile (and run in the interpreter) without them."""
    if not (_PDL_ALLOWED and _HAS_GDC) or device.type != "cuda" or triton_interpreter_enabled():
        return False
    return cuda_capability(cuda_index(device)) >= (9, 0)


__all__ = ["ENV_PDL", "gdc_launch_dependents", "gdc_wait", "programmatic_launch_enabled"]
