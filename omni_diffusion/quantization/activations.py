"""Folding a GELU into the W8A8 layer that reads its output.

A GELU whose output one W8A8 layer alone reads (a DiT's MLP down projection;
Flux's and HunyuanVideo's single blocks' ``proj_out``, which reads
``cat(attention, GELU(proj_mlp(x)))``) is folded into that layer
(``QuantConfig.fuse_activations``, on by default for W8A8), where the adapter
declares it (:attr:`omni_diffusion.adapters.base.ModelAdapter.activation_fusions`):
the GELU module goes (``nn.GELU`` becomes ``nn.Identity``; diffusers' ``GELU``
becomes :class:`GELUProjection`, its ``proj`` alone) and the layer applies the
GELU in its quantization pass (``QuantizedLinear.input_activation``,
:func:`omni_kernels.quant.quantize_activated_per_token`), so the GELU's output
is never written in 16 bits. The GELU is computed in float32 and quantized
without rounding it to bfloat16 first (the unfused path rounds it once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from omni_diffusion.quantization.modules import append_record, is_instance_of, replace_submodule
from omni_kernels.quant import QuantizedLinear

if TYPE_CHECKING:
    from omni_diffusion.adapters.base import ModelAdapter

logger = logging.getLogger("omni_diffusion.quantization")

# Where quantize() records the GELUs it folded into their consumers (module.__dict__).
_ACTIVATION_RECORD_ATTR = "_omni_fused_activations"


class GELUProjection(nn.Module):
    """diffusers' ``GELU`` module (``proj`` then a GELU) without its GELU: the linear layer
    reading its output applies the GELU instead (``QuantizedLinear.input_activation``).
    ``proj`` keeps its name, so ``state_dict`` keys do not change."""

    def __init__(self, gelu: nn.Module) -> None:
        super().__init__()
        self.proj = gelu.proj
        self.approximate = gelu.approximate

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.proj(hidden_states)


@dataclass(frozen=True)
class ActivationSite:
    """One GELU to fold: full module names and the consumer's first activated input column."""

    activation: str
    consumer: str
    activation_from: int


def _is_tanh_gelu(module: nn.Module) -> str | None:
    """``"module"`` for ``nn.GELU(approximate="tanh")``, ``"projection"`` for diffusers'
    ``GELU`` with ``approximate="tanh"`` (a ``proj`` linear then the GELU), else ``None``."""
    if isinstance(module, nn.GELU):
        return "module" if module.approximate == "tanh" else None
    if is_instance_of(module, "GELU") and getattr(module, "approximate", None) == "tanh" and isinstance(
        getattr(module, "proj", None), (nn.Linear, QuantizedLinear)
    ):
        return "projection"
    return None


def plan_activation_fusion(module: nn.Module, adapter: ModelAdapter | None) -> list[ActivationSite]:
    """The GELUs of ``module`` that :func:`quantize` folds into the W8A8 layer reading them.

    For each of the adapter's :class:`~omni_diffusion.adapters.base.ActivationFusion`, every
    module of its owner class where the activation is a tanh GELU, the passthrough modules
    are dropouts or identities and the consumer is a W8A8 :class:`QuantizedLinear` (so run
    it after the layers are quantized) that applies no activation yet. Anything else is
    left as it is (logged at debug level).
    """
    if adapter is None or not adapter.activation_fusions:
        return []
    sites = []
    for owner_name, owner in module.named_modules():
        for fusion in adapter.activation_fusions:
            if not is_instance_of(owner, fusion.owner_class):
                continue
            prefix = f"{owner_name}." if owner_name else ""
            try:
                activation = owner.get_submodule(fusion.activation)
                consumer = owner.get_submodule(fusion.consumer)
                between = [owner.get_submodule(name) for name in fusion.passthrough]
                source = owner.get_submodule(fusion.concatenated_after) if fusion.concatenated_after else None
            except AttributeError as exc:
                logger.debug("quantize: not folding the GELU of %s: %s", owner_name, exc)
                continue
            why = (
                "the activation is not a tanh GELU" if _is_tanh_gelu(activation) is None else
                "a module between is not a dropout/identity"
                if not all(isinstance(m, (nn.Dropout, nn.Identity)) for m in between) else
                "its consumer is not a W8A8 QuantizedLinear"
                if not isinstance(consumer, QuantizedLinear) or consumer.weight_only else
                "its consumer already applies an activation" if consumer.input_activation is not None else
                None
            )
            activation_from = 0
            if why is None and source is not None:
                width = getattr(source, "out_features", None)
                activation_from = consumer.in_features - width if isinstance(width, int) else -1
                if not 0 < activation_from < consumer.in_features:
                    why = f"{fusion.concatenated_after} does not fill the end of the consumer's input"
            if why is not None:
                logger.debug("quantize: not folding %s%s into %s%s: %s", prefix, fusion.activation, prefix,
                             fusion.consumer, why)
                continue
            sites.append(ActivationSite(prefix + fusion.activation, prefix + fusion.consumer, activation_from))
    return sites


def fold_activation(module: nn.Module, site: ActivationSite) -> None:
    activation = module.get_submodule(site.activation)
    kind = _is_tanh_gelu(activation)
    if kind is None:
        raise ValueError(f"cannot fold {site.activation}: a {type(activation).__name__}, not a tanh GELU")
    consumer = module.get_submodule(site.consumer)
    if not isinstance(consumer, QuantizedLinear):
        raise ValueError(f"cannot fold {site.activation} into {site.consumer}: not a QuantizedLinear")
    consumer.set_input_activation("gelu_tanh", site.activation_from)
    replace_submodule(module, site.activation, nn.Identity() if kind == "module" else GELUProjection(activation))


def record_activations(module: nn.Module, sites: list[ActivationSite]) -> None:
    append_record(module, _ACTIVATION_RECORD_ATTR, sites)


def forget_folded_activations(module: nn.Module) -> None:
    """Drop ``module``'s record of folded GELUs, once the caller has put the GELU modules
    and their full-precision consumers back (``accelerate()``'s undo)."""
    module.__dict__.pop(_ACTIVATION_RECORD_ATTR, None)


def fused_activations(module: nn.Module) -> dict[str, dict[str, Any]]:
    """``{consumer: {"activation": name, "activation_from": column}}`` of the GELUs
    :func:`quantize` (or :func:`load_quantized`) folded into quantized layers of ``module``."""
    return {site.consumer: {"activation": site.activation, "activation_from": site.activation_from}
            for site in module.__dict__.get(_ACTIVATION_RECORD_ATTR, [])}
