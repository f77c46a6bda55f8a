"""The model family's adapter of a module, for callers of quantize() / plan_fusion() /
load_quantized() that pass none.

:mod:`omni_diffusion.adapters` sets the lookup when it is imported (which ``import
omni_diffusion`` does): quantization never imports the adapters, which import it for their
norm-fused forwards. ``accelerate()`` passes its adapter and never needs this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from omni_diffusion.adapters.base import ModelAdapter

_lookup: Callable[[nn.Module], ModelAdapter] | None = None


def set_adapter_lookup(lookup: Callable[[nn.Module], ModelAdapter]) -> None:
    """Use ``lookup(module)`` (``ValueError`` for an unknown family) when a caller passes no adapter."""
    global _lookup
    _lookup = lookup


def resolve_adapter(module: nn.Module, adapter: ModelAdapter | None) -> ModelAdapter | None:
    """``adapter``, else the registered family's adapter of ``module``, else None (nothing declared to fuse)."""
    if adapter is not None or _lookup is None:
        return adapter
    try:
        return _lookup(module)
    except ValueError:  # not a registered family
        return None
