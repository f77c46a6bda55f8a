"""Fusing an attention's q/k/v projections into one layer before quantizing, and taking it back.

Projections that read one input (an attention's ``to_q``/``to_k``/``to_v``,
and its ``add_q/k/v_proj`` over the text) can be fused before quantizing
(``QuantConfig.fuse_projections``, on by default for W8A8): where the model
family's adapter declares them (:attr:`omni_diffusion.adapters.base.ModelAdapter.fusable_attention`),
the attention module's own diffusers ``fuse_projections()`` builds ``to_qkv``
(``to_added_qkv``), the three separate layers are removed, and the fused layer
is quantized, so one activation quantization and one GEMM serve q, k and v. A
triple is fused only when all three layers would be quantized (a ``skip`` or
``include`` pattern naming one of them keeps the three separate). Fusing
changes no number: per-token activation scales depend on the shared input
only, per-output-channel weight scales on their own row. Tensor parallelism
(:mod:`omni_diffusion.parallel`) shards the separate ``to_q/k/v`` first
(``accelerate()`` orders it so); fusing then concatenates this rank's shards,
whose ``chunk(3)`` are this rank's heads of q, k and v, so the two compose.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from omni_diffusion.quantization.adapter_lookup import resolve_adapter
from omni_diffusion.quantization.config import QuantConfig
from omni_diffusion.quantization.modules import append_record
from omni_diffusion.quantization.plan import LayerPlan, plan_quantization

if TYPE_CHECKING:
    from omni_diffusion.adapters.base import ModelAdapter

logger = logging.getLogger("omni_diffusion.quantization")

# The projections diffusers' fuse_projections() merges: fused layer, then its members in output order.
FUSED_PROJECTIONS = (
    ("to_qkv", ("to_q", "to_k", "to_v")),
    ("to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj")),
)
# Where quantize() records the attention modules it fused (module.__dict__, not a submodule).
_FUSION_RECORD_ATTR = "_omni_fused_attention"


@dataclass
class FusedAttention:
    """One attention module whose projections :func:`quantize` fused, and what it changed."""

    name: str
    processor: Any  # the processor before fusion
    own_flag: bool  # whether ``fused_projections`` was an instance attribute before
    flag: Any
    # attn's submodule names in their order before fusion: unfusing puts the order back,
    # so named_modules() and state_dict() list them as before
    module_order: tuple[str, ...] = ()


def fusion_groups(attn: nn.Module) -> list[tuple[str, tuple[str, ...]]] | None:
    """The ``(fused name, members)`` pairs ``attn.fuse_projections()`` would build, or None
    when it cannot fuse ``attn`` the way the processors read it (not self-attention over one
    input, a triple incomplete or not plain linears of equal shapes)."""
    if not callable(getattr(attn, "fuse_projections", None)) or getattr(attn, "fused_projections", False):
        return None
    if getattr(attn, "is_cross_attention", False) or not getattr(attn, "_supports_qkv_fusion", True):
        return None
    groups = []
    for fused, members in FUSED_PROJECTIONS:
        layers = [getattr(attn, m, None) for m in members]
        if all(layer is None for layer in layers) and fused != "to_qkv":
            continue
        if not all(isinstance(layer, nn.Linear) for layer in layers):
            return None
        if len({(layer.in_features, layer.out_features, layer.bias is not None) for layer in layers}) != 1:
            return None
        groups.append((fused, members))
    return groups


def plan_fusion(module: nn.Module, config: QuantConfig | dict, adapter: ModelAdapter | None = None,
                plans: list[LayerPlan] | None = None) -> list[str]:
    """The attention modules of ``module`` whose projections :func:`quantize` fuses, in module order.

    Those matching the adapter's ``fusable_attention`` patterns (``adapter``:
    a :class:`~omni_diffusion.adapters.base.ModelAdapter`; default the
    registered family of ``module``'s class, none: nothing is fused), whose
    q/k/v (and added q/k/v) layers :func:`plan_quantization` all quantizes, and
    for which the adapter has a processor that reads fused projections. A triple
    whose layers get different methods (``layer_methods``) is not fused. Empty
    when ``config.fuses_projections`` is off.
    """
    config = QuantConfig.from_dict(config)
    adapter = resolve_adapter(module, adapter)
    if not config.fuses_projections or adapter is None or not adapter.fusable_attention:
        return []
    plans = plan_quantization(module, config) if plans is None else plans
    quantized = {p.name: p.method for p in plans if p.action == "quantize"}
    names = []
    for name, attn in module.named_modules():
        if not name or not any(fnmatch.fnmatchcase(name, p) for p in adapter.fusable_attention):
            continue
        groups = fusion_groups(attn)
        if groups is None:
            continue
        if any(f"{name}.{m}" not in quantized for _, members in groups for m in members):
            continue
        methods = {(fused, quantized[f"{name}.{m}"]) for fused, members in groups for m in members}
        if len(methods) != len(groups):
            logger.debug("quantize: not fusing %s: layer_methods gives its projections different methods", name)
            continue
        if adapter.fused_attention_processor(attn) is None:
            logger.debug("quantize: not fusing %s: the %s adapter has no fused processor for %s",
                         name, adapter.name, type(getattr(attn, "processor", None)).__name__)
            continue
        names.append(name)
    return names


def fuse_attention_module(module: nn.Module, name: str,
                    adapter: ModelAdapter | None) -> tuple[FusedAttention, dict[str, nn.Module]]:
    """Fuse attention ``name``'s projections in place; returns the record and the removed layers."""
    attn = module.get_submodule(name)
    groups = fusion_groups(attn)
    processor = adapter.fused_attention_processor(attn) if adapter is not None else None
    if groups is None or processor is None:
        why = ("no model adapter describes it" if adapter is None else
               "its q/k/v are not three plain linears of one shape" if groups is None else
               f"the {adapter.name!r} adapter has no processor that runs them fused")
        raise ValueError(
            f"cannot fuse the projections of {name} ({type(attn).__name__}, processor "
            f"{type(getattr(attn, 'processor', None)).__name__}): {why}"
        )
    record = FusedAttention(name, attn.processor, "fused_projections" in attn.__dict__,
                             attn.__dict__.get("fused_projections"), tuple(attn._modules))
    with torch.no_grad():
        attn.fuse_projections()
    removed = {}
    for fused, members in groups:
        if not isinstance(getattr(attn, fused, None), nn.Linear):
            raise RuntimeError(f"{type(attn).__name__}.fuse_projections() built no {fused} for {name}")
        for member in members:
            removed[member] = attn._modules.pop(member)
    if processor is not attn.processor:
        attn.set_processor(processor)
    return record, removed


def unfuse_attention_module(module: nn.Module, record: FusedAttention,
                      removed: dict[str, nn.Module] | None = None) -> None:
    attn = module.get_submodule(record.name)
    for member, layer in (removed or {}).items():
        setattr(attn, member, layer)
    for fused, _ in FUSED_PROJECTIONS:
        attn._modules.pop(fused, None)
    position = {child: i for i, child in enumerate(record.module_order)}
    children = sorted(attn._modules.items(), key=lambda item: position.get(item[0], len(position)))
    attn._modules.clear()
    attn._modules.update(children)
    if record.own_flag:
        attn.fused_projections = record.flag
    else:
        attn.__dict__.pop("fused_projections", None)
    if attn.processor is not record.processor:
        attn.set_processor(record.processor)


def record_fusion(module: nn.Module, fused: list[tuple[FusedAttention, dict]]) -> None:
    append_record(module, _FUSION_RECORD_ATTR, [record for record, _ in fused])


def fused_attention(module: nn.Module) -> list[str]:
    """The attention modules of ``module`` whose projections :func:`quantize` (or
    :func:`load_quantized`) fused."""
    return [record.name for record in module.__dict__.get(_FUSION_RECORD_ATTR, [])]


def unfuse_projections(module: nn.Module) -> None:
    """Take back the projection fusion :func:`quantize` did on ``module``: the fused
    layers are removed, each attention's ``fused_projections`` flag and processor are
    what they were. The separate q/k/v layers must be on their modules again first:
    :func:`quantize` releases them (like every replaced full-precision layer), and
    :func:`omni_diffusion.accelerate`'s undo puts its kept originals back before
    calling this.

    Raises:
        ValueError: a fused attention whose separate projections are not back.
    """
    records = module.__dict__.get(_FUSION_RECORD_ATTR, [])
    for record in records:
        attn = module.get_submodule(record.name)
        missing = [m for fused, members in FUSED_PROJECTIONS if fused in attn._modules
                   for m in members if m not in attn._modules]
        if missing:
            raise ValueError(
                f"unfuse_projections: {record.name} has no {missing}: quantize() released the "
                "separate projections; only accelerate()'s undo keeps them"
            )
    for record in reversed(records):
        unfuse_attention_module(module, record)
    module.__dict__.pop(_FUSION_RECORD_ATTR, None)


def unfused_name(name: str) -> str:
    """A fused projection's first member (``attn.to_qkv`` -> ``attn.to_q``); other names as they are."""
    parent, _, last = name.rpartition(".")
    for fused, members in FUSED_PROJECTIONS:
        if last == fused:
            return f"{parent}.{members[0]}" if parent else members[0]
    return name
