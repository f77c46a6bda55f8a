"""save_quantized / load_quantized: a quantized model's state_dict in a safetensors file, with
metadata enough to rebuild the same layers (and fusions) without quantizing again."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from omni_diffusion.quantization.activations import (
    ActivationSite,
    fold_activation,
    fused_activations,
    record_activations,
)
from omni_diffusion.quantization.adapter_lookup import resolve_adapter
from omni_diffusion.quantization.apply import quantized_layers
from omni_diffusion.quantization.concat_free import install_concat_free_forwards
from omni_diffusion.quantization.config import QuantConfig
from omni_diffusion.quantization.modules import replace_submodule
from omni_diffusion.quantization.norm_fusion import install_norm_fused_forwards
from omni_diffusion.quantization.projections import (
    FusedAttention,
    fuse_attention_module,
    fused_attention,
    record_fusion,
    unfuse_attention_module,
    unfused_name,
)
from omni_kernels.quant import QuantizedLinear

if TYPE_CHECKING:
    from omni_diffusion.adapters.base import ModelAdapter

_FORMAT = "omni-quant/1"
_METADATA_FORMAT_KEY = "omni_quant_format"
_METADATA_LAYERS_KEY = "omni_quant_layers"
_METADATA_CONFIG_KEY = "omni_quant_config"
_METADATA_FUSED_KEY = "omni_quant_fused_attention"
_METADATA_ACTIVATIONS_KEY = "omni_quant_fused_activations"


def save_quantized(module: nn.Module, path: str | os.PathLike, config: QuantConfig | dict | None = None) -> None:
    """Write ``module``'s whole ``state_dict`` (quantized and full-precision parts) to a safetensors file.

    The file's metadata records which layers are quantized and how, which
    attention modules have fused projections, which GELUs are folded into their
    consumers (and ``config``, when given), so
    :func:`load_quantized` rebuilds the same layers without quantizing anything.
    """
    layers = quantized_layers(module)
    if not layers:
        raise ValueError(f"{type(module).__name__} has no quantized layers: call quantize() before save_quantized()")
    from safetensors.torch import save_file

    metadata = {_METADATA_FORMAT_KEY: _FORMAT, _METADATA_LAYERS_KEY: json.dumps(layers)}
    if fused_attention(module):
        metadata[_METADATA_FUSED_KEY] = json.dumps(fused_attention(module))
    if fused_activations(module):
        metadata[_METADATA_ACTIVATIONS_KEY] = json.dumps(fused_activations(module))
    if config is not None:
        metadata[_METADATA_CONFIG_KEY] = json.dumps(QuantConfig.from_dict(config).to_dict())
    tensors = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    save_file(tensors, os.fspath(path), metadata=metadata)


def _check_methods_match(config: QuantConfig, layers: dict[str, str], path: str) -> None:
    """``ValueError`` unless every layer of the file has the method ``config`` gives it."""
    wrong = {name: (method, config.method_for(unfused_name(name))) for name, method in layers.items()
             if method != config.method_for(unfused_name(name))}
    if not wrong:
        return
    if not config.layer_methods:
        raise ValueError(
            f"QuantConfig.method={config.method!r} does not match {path}, whose layers are "
            f"{sorted(set(layers.values()))}"
        )
    shown = "; ".join(f"{name}: file {got!r}, config {want!r}" for name, (got, want) in list(wrong.items())[:4])
    raise ValueError(
        f"QuantConfig (method={config.method!r}, layer_methods={list(config.layer_methods)}) does not "
        f"match {path} for {len(wrong)} layer(s): {shown}{'; ...' if len(wrong) > 4 else ''}"
    )


def load_quantized(
    module: nn.Module,
    path: str | os.PathLike,
    config: QuantConfig | dict | None = None,
    *,
    device: str | torch.device | None = None,
    adapter: ModelAdapter | None = None,
) -> nn.Module:
    """Load a file written by :func:`save_quantized` into ``module`` (the unquantized skeleton).

    The layers the file lists are replaced by :class:`QuantizedLinear` layers
    (no weight is quantized: the stored 8-bit weights and scales are loaded as
    they are), then the whole ``state_dict`` is loaded strictly, assigning the
    file's tensors (so a skeleton on the ``meta`` device works and never
    allocates the full-precision weights; non-persistent buffers, which no
    ``state_dict`` holds, must then be materialized by the caller). ``device``: where the tensors go;
    default the skeleton's device (CPU for ``meta``). ``config``: optional;
    its method (``method_for`` each layer: ``layer_methods`` included) must match the
    file's, its backend options apply to the layers
    (default: the options saved in the file, else the defaults). Attention
    modules the file has fused projections for are fused in ``module`` first,
    with ``adapter``'s processors (default: the adapter of ``module``'s class),
    and the GELUs it folded into their consumers are folded again.

    Raises:
        ValueError: not an omni quantized file, a config whose method differs,
            a listed layer that is not an ``nn.Linear`` of ``module``, or keys
            that do not match ``module``.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = os.fspath(path)
    with safe_open(path, framework="pt") as handle:
        metadata = handle.metadata() or {}
    if metadata.get(_METADATA_FORMAT_KEY) != _FORMAT or _METADATA_LAYERS_KEY not in metadata:
        raise ValueError(f"{path} is not an omni quantized checkpoint (no {_METADATA_FORMAT_KEY!r} metadata)")
    layers: dict[str, str] = json.loads(metadata[_METADATA_LAYERS_KEY])
    saved_config = (
        QuantConfig.from_dict(json.loads(metadata[_METADATA_CONFIG_KEY]))
        if _METADATA_CONFIG_KEY in metadata else None
    )
    if config is not None:
        config = QuantConfig.from_dict(config)
        _check_methods_match(config, layers, path)
    options = (config or saved_config or QuantConfig()).layer_options()

    if device is None:
        first = next(iter(module.parameters()), None)
        device = first.device if first is not None and first.device.type != "meta" else torch.device("cpu")
    device = torch.device(device)
    model = type(module).__name__
    fused_names = json.loads(metadata.get(_METADATA_FUSED_KEY, "[]"))
    already = set(fused_attention(module))
    fused: list[tuple[FusedAttention, dict[str, nn.Module]]] = []
    if fused_names:
        adapter = resolve_adapter(module, adapter)
    targets = {}
    try:
        for name in fused_names:
            if name in already:
                continue
            try:
                module.get_submodule(name)
            except AttributeError:
                raise ValueError(f"{path} fuses the projections of {name!r}, which {model} does not have") from None
            fused.append(fuse_attention_module(module, name, adapter))
        for name in layers:  # every listed layer is checked before anything is replaced
            try:
                targets[name] = module.get_submodule(name)
            except AttributeError:
                raise ValueError(f"{path} quantizes layer {name!r}, which {model} does not have") from None
            if not isinstance(targets[name], (nn.Linear, QuantizedLinear)):
                raise ValueError(
                    f"{path} quantizes {name!r}, which is a {type(targets[name]).__name__} in {model}, not nn.Linear"
                )
    except BaseException:
        for record, removed in reversed(fused):
            unfuse_attention_module(module, record, removed)
        raise
    record_fusion(module, fused)
    for name, method in layers.items():
        layer = targets[name]
        new = QuantizedLinear(
            layer.in_features, layer.out_features, layer.bias is not None, method, device="meta", **options
        )
        new.train(layer.training)
        replace_submodule(module, name, new)

    sites = [ActivationSite(entry["activation"], consumer, int(entry["activation_from"]))
             for consumer, entry in json.loads(metadata.get(_METADATA_ACTIVATIONS_KEY, "{}")).items()]
    for site in sites:
        try:
            fold_activation(module, site)
        except AttributeError:
            raise ValueError(f"{path} folds {site.activation} into {site.consumer}, which {model} does not have") from None
    record_activations(module, sites)
    adapter = resolve_adapter(module, adapter)
    install_norm_fused_forwards(module, adapter)
    if sites:
        install_concat_free_forwards(module, adapter)

    state = load_file(path, device=str(device))
    result = module.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"{path} does not match {model}: missing keys {result.missing_keys[:8]}, "
            f"unexpected keys {result.unexpected_keys[:8]}"
        )
    return module
