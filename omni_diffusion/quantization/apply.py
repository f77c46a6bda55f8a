"""quantize(): swap a model's linear layers for quantized ones in place, with the fusions its
adapter declares."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from omni_diffusion.quantization.activations import (
    ActivationSite,
    fold_activation,
    plan_activation_fusion,
    record_activations,
)
from omni_diffusion.quantization.adapter_lookup import resolve_adapter
from omni_diffusion.quantization.concat_free import install_concat_free_forwards
from omni_diffusion.quantization.config import QuantConfig
from omni_diffusion.quantization.modules import replace_submodule
from omni_diffusion.quantization.norm_fusion import install_norm_fused_forwards
from omni_diffusion.quantization.plan import LayerPlan, check_hardware, plan_quantization, warn_idle_layer_methods
from omni_diffusion.quantization.projections import (
    FUSED_PROJECTIONS,
    FusedAttention,
    fuse_attention_module,
    fusion_groups,
    plan_fusion,
    record_fusion,
    unfuse_attention_module,
)
from omni_kernels.quant import QuantizedLinear

if TYPE_CHECKING:
    from omni_diffusion.adapters.base import ModelAdapter

logger = logging.getLogger("omni_diffusion.quantization")


def _swap_linear(module: nn.Module, name: str, method: str, options: dict,
                 on_released: Callable[[str, nn.Module], None] | None = None) -> nn.Module | None:
    """Replace linear ``name`` by its :class:`QuantizedLinear`; returns it when ``name`` is the root."""
    linear = module.get_submodule(name)
    with torch.no_grad():
        new = QuantizedLinear.from_linear(linear, method, **options)
    new.train(linear.training)
    if name:
        replace_submodule(module, name, new)
        if on_released is not None:
            on_released(name, linear)
        return None
    return new


def quantize(module: nn.Module, config: QuantConfig | dict | None = None, *,
             adapter: ModelAdapter | None = None,
             on_released: Callable[[str, nn.Module], None] | None = None) -> nn.Module:
    """Quantize the ``nn.Linear`` layers of ``module`` in place; returns ``module``.

    Each chosen layer (:func:`plan_quantization`) is replaced by a
    :class:`QuantizedLinear` on the layer's device, its weight quantized per
    output channel and the full-precision weight released. ``config`` is a
    :class:`QuantConfig`, a dict for :meth:`QuantConfig.from_dict`, or ``None``
    (FP8, nothing skipped). If ``module`` is itself an ``nn.Linear``, the
    replacement is returned (it cannot be swapped in place).

    With ``config.fuses_projections``, the attention projections
    :func:`plan_fusion` names are fused first (:mod:`.projections`), one attention
    at a time just before its fused layers are quantized; :func:`fused_attention`
    lists them afterwards. ``adapter``: the model family's
    :class:`~omni_diffusion.adapters.base.ModelAdapter` (default: looked up from
    ``module``'s class; none found: nothing is fused).

    ``on_released(name, layer)``, if given, is called with each full-precision linear as soon
    as it has left the model (its :class:`QuantizedLinear` is in place; for fused projections,
    the three separate layers once the fused one is quantized), so that a caller keeping the
    originals (:func:`omni_diffusion.accelerate`, for its undo) can move each one off the GPU
    at once: the model then never holds both precisions in full. (If ``quantize`` raises, the
    separate projections it fused are put back as they are then.)

    Raises:
        ValueError: a bad config, a pattern that matches no module, an included
            layer the kernels cannot take.
        RuntimeError: an FP8 method for a model on a GPU without FP8 tensor cores.
    """
    config = QuantConfig() if config is None else QuantConfig.from_dict(config)
    plans = plan_quantization(module, config)
    warn_idle_layer_methods(plans, config)
    check_hardware(module, plans, config)
    if config.fuses_projections or config.fuses_activations or config.fuses_norms:  # the family's declarations
        adapter = resolve_adapter(module, adapter)
    replaced, fused = _swap_layers(module, plans, config, adapter, on_released)
    record_fusion(module, fused)
    folded: list[ActivationSite] = []
    if config.fuses_activations and replaced is None:
        folded = plan_activation_fusion(module, adapter)
        for site in folded:
            fold_activation(module, site)
        record_activations(module, folded)
    norm_fused = install_norm_fused_forwards(module, adapter) if config.fuses_norms and replaced is None else []
    if config.fuse_norms and not norm_fused:  # asked for explicitly
        logger.warning(
            "quantize: fuse_norms=True, but no block of %s took a norm-fused forward (%s; debug logging "
            "says why each declared block did not)", type(module).__name__,
            "no model adapter" if adapter is None else
            f"the {adapter.name!r} adapter declares none" if not adapter.norm_fusions else
            f"the {adapter.name!r} adapter declares {', '.join(f.owner_class for f in adapter.norm_fusions)}",
        )
    if config.fuses_activations and replaced is None:
        install_concat_free_forwards(module, adapter)
    _log_summary(module, config, plans, len(fused), len(folded), len(norm_fused))
    return replaced if replaced is not None else module


def _swap_layers(
    module: nn.Module, plans: list[LayerPlan], config: QuantConfig, adapter: ModelAdapter | None,
    on_released: Callable[[str, nn.Module], None] | None,
) -> tuple[nn.Module | None, list[tuple[FusedAttention, dict[str, nn.Module]]]]:
    """Quantize the planned layers, fusing each attention :func:`plan_fusion` names just before
    its fused layers; returns the root's replacement (``module`` itself a linear, else None) and
    the fused attentions with their removed layers. On an error the fusions are taken back."""
    fusing = plan_fusion(module, config, adapter, plans)
    method_of = {p.name: p.method for p in plans}
    member_of = {f"{a}.{m}": a for a in fusing for _, members in fusion_groups(module.get_submodule(a))
                 for m in members}
    options = config.layer_options()
    replaced = None
    fused: list[tuple[FusedAttention, dict[str, nn.Module]]] = []
    done: set[str] = set()
    try:
        for plan in plans:
            if plan.action != "quantize":
                logger.debug("quantize: keeping %s (%d -> %d) in full precision: %s",
                             plan.name or "<root>", plan.in_features, plan.out_features, plan.reason)
                continue
            attn_name = member_of.get(plan.name)
            if attn_name is None:
                replaced = _swap_linear(module, plan.name, plan.method, options, on_released) or replaced
                continue
            if attn_name in done:
                continue  # its fused layers are already quantized
            done.add(attn_name)
            fused.append(fuse_attention_module(module, attn_name, adapter))
            attn = module.get_submodule(attn_name)
            for fused_name, members in FUSED_PROJECTIONS:
                if fused_name in attn._modules:
                    # plan_fusion fuses only triples whose members share one method
                    method = method_of[f"{attn_name}.{members[0]}"]
                    # (the bf16 fused layer fuse_projections() built is dropped here, not released)
                    _swap_linear(module, f"{attn_name}.{fused_name}", method, options)
            if on_released is not None:
                for member, layer in fused[-1][1].items():
                    on_released(f"{attn_name}.{member}", layer)
    except BaseException:  # put the separate projections back: the caller may restore the rest
        for record, removed in reversed(fused):
            unfuse_attention_module(module, record, removed)
        raise
    return replaced, fused


def _log_summary(module: nn.Module, config: QuantConfig, plans: list[LayerPlan], fused: int, folded: int,
                 norm_fused: int) -> None:
    kept = [p for p in plans if p.action == "keep"]
    others = collections.Counter(p.method for p in plans if p.action == "quantize" and p.method != config.method)
    logger.info(
        "quantize: %s: %d of %d linear layers to %s%s%s%s%s; %d kept in full precision%s",
        type(module).__name__, len(plans) - len(kept), len(plans), config.method,
        f" ({', '.join(f'{n} to {m}' for m, n in others.items())} by layer_methods)" if others else "",
        f" ({fused} attention modules' q/k/v fused)" if fused else "",
        f" ({folded} GELUs folded into their consumers' quantization)" if folded else "",
        f" ({norm_fused} blocks quantize their norm outputs in one fused kernel)" if norm_fused else "",
        len(kept),
        (" (" + "; ".join(f"{p.name}: {p.reason}" for p in kept[:8]) + ("; ..." if len(kept) > 8 else "") + ")")
        if kept else "",
    )


def quantized_layers(module: nn.Module) -> dict[str, str]:
    """``{name: method}`` of the :class:`QuantizedLinear` layers of ``module``."""
    return {name: m.method for name, m in module.named_modules() if isinstance(m, QuantizedLinear)}
