"""Edits of a module tree that the quantization steps share: replacing a submodule, finding the
modules of a class, installing an instance ``forward`` and taking it back, and the records of
what was changed (kept in the root module's ``__dict__``, never as submodules)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator

from torch import nn


def replace_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` in place of ``root``'s submodule ``name`` (dotted)."""
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def is_instance_of(module: nn.Module, class_name: str) -> bool:
    """Whether ``module``'s class or one of its bases is named ``class_name`` (no diffusers import)."""
    return class_name in {cls.__name__ for cls in type(module).__mro__}


def modules_of_class(root: nn.Module, class_name: str) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` for each module of ``root`` that :func:`is_instance_of` ``class_name``."""
    return ((name, module) for name, module in root.named_modules() if is_instance_of(module, class_name))


def append_record(root: nn.Module, attr: str, entries: list) -> None:
    """Add ``entries`` to ``root``'s record ``attr`` (nothing when empty)."""
    if entries:
        root.__dict__[attr] = [*root.__dict__.get(attr, []), *entries]


def instance_forward_unfit(owner: nn.Module, function: Callable) -> str | None:
    """Why ``function`` cannot become ``owner``'s instance ``forward``, or ``None``: ``owner`` already
    has one (someone else's wrapper), or its class ``forward`` takes other parameters (a diffusers
    version ``function`` was not written for)."""
    if "forward" in owner.__dict__:
        return "it already has an instance forward"
    wanted = list(inspect.signature(function).parameters)[1:]
    takes = list(inspect.signature(type(owner).forward).parameters)[1:]
    return f"its forward takes {takes}, not {wanted}" if takes != wanted else None


def remove_instance_forwards(root: nn.Module, record_attr: str) -> None:
    """Drop the instance forwards recorded as ``[(name, function)]`` under ``record_attr`` (one
    that is no longer the installed function is left alone) and the record."""
    for name, function in root.__dict__.pop(record_attr, []):
        owner = root.get_submodule(name)
        current = owner.__dict__.get("forward")
        if getattr(current, "__func__", None) is function and getattr(current, "__self__", None) is owner:
            del owner.__dict__["forward"]
