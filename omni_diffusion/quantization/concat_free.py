"""Forwards that let a folded GELU's consumer read its two concatenated inputs apart (no 16-bit
``cat``), installed on the blocks the model's adapter declares them for."""

from __future__ import annotations

import logging
import types
from typing import TYPE_CHECKING, Any

from torch import nn

from omni_diffusion.quantization.modules import (
    append_record,
    instance_forward_unfit,
    modules_of_class,
    remove_instance_forwards,
)
from omni_kernels.quant import QuantizedLinear

if TYPE_CHECKING:
    from omni_diffusion.adapters.base import ModelAdapter

logger = logging.getLogger("omni_diffusion.quantization")

# Where it records the owners given a concat-free forward: [(name, function)] (module.__dict__).
_CONCAT_FREE_RECORD_ATTR = "_omni_concat_free_forwards"


def install_concat_free_forwards(module: nn.Module, adapter: ModelAdapter | None) -> list[str]:
    """Give each owner of a folded, concatenated GELU its adapter's ``concat_free_forward``.

    For every :class:`~omni_diffusion.adapters.base.ActivationFusion` of ``adapter`` with
    one, each module of its owner class whose consumer is a :class:`QuantizedLinear`
    applying the GELU from exactly the column where ``concatenated_after``'s output
    starts gets that function as its instance ``forward`` (so its consumer reads the two
    inputs apart: no 16-bit ``cat``). Skipped, with a debug log: an owner that already
    has an instance ``forward`` (someone else's wrapper), or whose class ``forward`` takes
    other parameters than the function (a diffusers version it was not written for).
    Returns the owners' names; :func:`remove_concat_free_forwards` undoes it.
    """
    if adapter is None:
        return []
    installed: list[tuple[str, Any]] = []
    for fusion in adapter.activation_fusions:
        function = fusion.concat_free_forward
        if function is None or fusion.concatenated_after is None:
            continue
        for name, owner in modules_of_class(module, fusion.owner_class):
            try:
                consumer = owner.get_submodule(fusion.consumer)
                source = owner.get_submodule(fusion.concatenated_after)
            except AttributeError:
                continue
            # (a tensor-parallel consumer, say, is no QuantizedLinear: its GELU was not folded)
            folded = isinstance(consumer, QuantizedLinear) and consumer.input_activation is not None
            why = (
                "its consumer does not apply the folded GELU after the other input"
                if not folded or consumer.activation_from
                != consumer.in_features - getattr(source, "out_features", consumer.in_features) else
                instance_forward_unfit(owner, function)
            )
            if why is not None:
                logger.debug("quantize: %s keeps its forward (and its cat): %s", name, why)
                continue
            owner.forward = types.MethodType(function, owner)
            installed.append((name, function))
    append_record(module, _CONCAT_FREE_RECORD_ATTR, installed)
    return [name for name, _ in installed]


def remove_concat_free_forwards(module: nn.Module) -> None:
    """Undo :func:`install_concat_free_forwards`: the owners' class ``forward`` again (an
    instance ``forward`` that is no longer the installed one is left alone)."""
    remove_instance_forwards(module, _CONCAT_FREE_RECORD_ATTR)
