"""Reversible instance-attribute patches (a wrapped ``forward``, a replaced VAE method).

Patching the instance, never the class or the module tree, leaves parameter names and
``state_dict`` keys untouched, so checkpoints load into a parallelized VAE unchanged.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

_MISSING = object()


class Patches:
    """Instance attributes set by VAE parallelism, restorable in reverse order."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        self._saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    def bind(self, obj: Any, name: str, function) -> None:
        """Set ``obj.<name>`` to ``function`` bound to ``obj`` (``function(obj, ...)``)."""
        self.set(obj, name, MethodType(function, obj))

    def undo(self) -> None:
        for obj, name, old in reversed(self._saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._saved.clear()
