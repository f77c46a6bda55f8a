"""The registry of model adapters: each family module registers its adapter here, and
:func:`adapter_for` / :func:`adapter_for_transformer` find the one for a pipeline or transformer."""

from __future__ import annotations

from typing import Any

from torch import nn

from omni_diffusion.adapters.base import ModelAdapter
from omni_diffusion.quantization.adapter_lookup import set_adapter_lookup

_ADAPTERS: list[ModelAdapter] = []


def register_adapter(cls: type[ModelAdapter]) -> type[ModelAdapter]:
    """Class decorator: add an instance of ``cls`` to the registry (a new
    registration of the same name replaces the old one)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}.name is empty")
    for index, existing in enumerate(_ADAPTERS):
        if existing.name == cls.name:
            _ADAPTERS[index] = cls()
            return cls
    _ADAPTERS.append(cls())
    return cls


def list_adapters() -> list[ModelAdapter]:
    return list(_ADAPTERS)


def supported_pipelines() -> list[str]:
    """The pipeline class names adapters declare."""
    return [name for adapter in _ADAPTERS for name in adapter.pipeline_classes]


def _mro_names(obj: Any) -> list[str]:
    cls = obj if isinstance(obj, type) else type(obj)
    return [c.__name__ for c in cls.__mro__]


def adapter_for_transformer(transformer: nn.Module | type) -> ModelAdapter:
    """The adapter whose ``transformer_classes`` hold ``transformer``'s class."""
    names = _mro_names(transformer)
    for adapter in _ADAPTERS:
        if any(name in adapter.transformer_classes for name in names):
            return adapter
    supported = [name for adapter in _ADAPTERS for name in adapter.transformer_classes]
    raise ValueError(
        f"omni has no adapter for the transformer {names[0]}; supported transformers: "
        f"{', '.join(supported)}"
    )


def adapter_for(pipe: Any) -> ModelAdapter:
    """The adapter for a pipeline instance or class.

    Raises:
        ValueError: no adapter declares the pipeline class or its transformer's
            class; the message lists the supported pipelines.
    """
    names = _mro_names(pipe)
    for name in names:
        for adapter in _ADAPTERS:
            if name in adapter.pipeline_classes:
                return adapter
    transformer = None if isinstance(pipe, type) else getattr(pipe, "transformer", None)
    if transformer is not None:
        try:
            return adapter_for_transformer(transformer)
        except ValueError:
            pass
    detail = "" if transformer is None else f" (transformer {type(transformer).__name__})"
    raise ValueError(
        f"omni has no adapter for {names[0]}{detail}; supported pipelines: "
        f"{', '.join(supported_pipelines())} (and other pipelines whose transformer is one of "
        f"{', '.join(n for a in _ADAPTERS for n in a.transformer_classes)})"
    )


# quantize() and load_quantized() called without an adapter find the family here.
set_adapter_lookup(adapter_for_transformer)
