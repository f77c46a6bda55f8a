"""Edits of a module tree the quantization steps share: replacing a submodule, taking back the
instance ``forward`` functions they installed."""

from __future__ import annotations

from torch import nn


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def _remove_instance_forwards(module: nn.Module, record_attr: str) -> None:
    for name, function in module.__dict__.pop(record_attr, []):
        owner = module.get_submodule(name)
        current = owner.__dict__.get("forward")
        if getattr(current, "__func__", None) is function and getattr(current, "__self__", None) is owner:
            del owner.__dict__["forward"]
