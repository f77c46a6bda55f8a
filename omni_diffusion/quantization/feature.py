"""What ``accelerate()`` applies for ``AccelConfig.quant``: the family adapter's skip and
weight-only patterns joined with the caller's, the originals kept (on CPU) for the undo."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from omni_diffusion.quantization.activations import forget_folded_activations
from omni_diffusion.quantization.apply import quantize
from omni_diffusion.quantization.concat_free import remove_concat_free_forwards
from omni_diffusion.quantization.config import QuantConfig, name_matches, normalize_layer_methods
from omni_diffusion.quantization.norm_fusion import remove_norm_fused_forwards
from omni_diffusion.quantization.projections import unfuse_projections

if TYPE_CHECKING:
    from omni_diffusion.adapters.base import ModelAdapter
    from omni_diffusion.config import AccelConfig

logger = logging.getLogger("omni_diffusion.accelerate")


def quant_config_for(transformer: nn.Module, adapter: ModelAdapter, config: AccelConfig) -> QuantConfig:
    """The :class:`QuantConfig` of ``config.quant`` for ``transformer``: the adapter's skip patterns
    and the caller's ``quant_skip``; the adapter's ``quant_weight_only`` layers 8-bit weights only
    (INT8 weight-only under a W8A8 method), after the caller's own ``layer_methods``, which win."""
    # The adapter's patterns cover the family; keep those this model has (a variant may lack
    # some layers, and quantize() rejects patterns that match nothing). The caller's go unfiltered.
    names = [name for name, _ in transformer.named_modules()]

    def present(patterns: tuple[str, ...]) -> list[str]:
        return [p for p in patterns if any(name_matches(n, p) for n in names)]

    fields: dict[str, Any] = dict(method=config.quant, skip=(*present(adapter.quant_skip), *config.quant_skip),
                                  **config.quant_options)
    family_weight_only = present(adapter.quant_weight_only)
    if family_weight_only:
        weight_only = config.quant if config.quant.endswith("_weight_only") else "int8_weight_only"
        own = normalize_layer_methods(fields.get("layer_methods", ()))  # raises on a bad value, naming it
        fields["layer_methods"] = (*own, *((p, weight_only) for p in family_weight_only))
    if config.quant_min_features is not None:
        fields["min_features"] = config.quant_min_features
    return QuantConfig(**fields)


def apply_quantization(transformer: nn.Module, adapter: ModelAdapter, config: AccelConfig) -> Callable[[], None]:
    """Quantize ``transformer`` in place as ``config.quant`` asks (:func:`quant_config_for`); returns
    the undo, which puts back the very modules that were there (kept on CPU meanwhile)."""
    quant_config = quant_config_for(transformer, adapter, config)
    before = [
        (parent, child_name, child)
        for parent in transformer.modules()
        for child_name, child in parent._modules.items()
        if child is not None
    ]
    # Keep the originals for undo without holding GPU memory: their tensors go to CPU unless
    # the module now in their place shares them (a bias, say). Each linear goes as soon as
    # quantize() releases it, so the model never holds both precisions in full (for Flux, half
    # as much memory again). Projections fused into one layer
    # (QuantConfig.fuse_projections) were removed: kept here too.
    moved: list[tuple[torch.Tensor, torch.device]] = []

    def offload(old: nn.Module, replacement: nn.Module | None) -> None:
        kept = {t.untyped_storage().data_ptr()
                for t in ([*replacement.parameters(), *replacement.buffers()] if replacement is not None else [])}
        for t in [*old.parameters(), *old.buffers()]:
            if t.device.type != "cpu" and t.untyped_storage().data_ptr() not in kept:
                moved.append((t, t.device))
                t.data = t.data.to("cpu")

    def released(name: str, layer: nn.Module) -> None:
        try:
            replacement = transformer.get_submodule(name)
        except AttributeError:  # a fused projection: its module is gone
            replacement = None
        offload(layer, replacement)

    try:
        quantize(transformer, quant_config, adapter=adapter, on_released=released)
    except BaseException:  # failed part-way: put back what was swapped, where it was
        for t, device in moved:
            t.data = t.data.to(device)
        for parent, n, old in before:
            if parent._modules.get(n) is not old:
                setattr(parent, n, old)
        raise
    swapped = [(parent, n, old) for parent, n, old in before if parent._modules.get(n) is not old]
    if not swapped:
        logger.warning("quant=%r changed no layer of %s", config.quant, type(transformer).__name__)
    for parent, n, old in swapped:  # what quantize() did not release itself (a folded GELU module)
        offload(old, parent._modules.get(n))

    def undo() -> None:
        remove_norm_fused_forwards(transformer)
        remove_concat_free_forwards(transformer)
        for t, device in moved:
            t.data = t.data.to(device)
        for parent, n, old in swapped:
            setattr(parent, n, old)
        # the separate q/k/v are back: drop the fused layers, restore flags and processors
        unfuse_projections(transformer)
        forget_folded_activations(transformer)

    return undo
