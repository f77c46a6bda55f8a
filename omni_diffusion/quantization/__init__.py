"""FP8/INT8 quantization of the linear layers of a diffusers transformer, in place.

    from omni_diffusion.quantization import QuantConfig, quantize, save_quantized, load_quantized

    config = QuantConfig(method="fp8", skip=("x_embedder", "context_embedder", "proj_out"))
    quantize(transformer, config)            # swaps nn.Linear -> QuantizedLinear, in place
    save_quantized(transformer, "flux-fp8.safetensors")
    ...
    load_quantized(fresh_transformer, "flux-fp8.safetensors")   # same layers, no re-quantizing

The model stays an ordinary ``nn.Module`` (a ``ModelMixin`` stays one): only
its ``nn.Linear`` children are replaced by
:class:`omni_kernels.quant.QuantizedLinear`, whose ``state_dict`` holds
``qweight`` (8-bit), ``weight_scale`` (float32, per output channel) and ``bias``.

One module per step: :mod:`.config` (QuantConfig), :mod:`.plan` (which layers),
:mod:`.projections` (q/k/v fusion), :mod:`.activations` (GELU folding), :mod:`.concat_free` and
:mod:`.norm_fusion` (the forwards installed on blocks), :mod:`.apply` (quantize), :mod:`.serialize`
(save/load), :mod:`.feature` (what ``accelerate()`` applies).
"""

from omni_diffusion.quantization.activations import GELUProjection, forget_folded_activations, fused_activations, \
    plan_activation_fusion
from omni_diffusion.quantization.apply import quantize, quantized_layers
from omni_diffusion.quantization.concat_free import install_concat_free_forwards, remove_concat_free_forwards
from omni_diffusion.quantization.config import DEFAULT_SKIP, QuantConfig, normalize_layer_methods
from omni_diffusion.quantization.feature import apply_quantization
from omni_diffusion.quantization.norm_fusion import (
    class_forward,
    install_norm_fused_forwards,
    layer_norm_unfit,
    norm_fused_blocks,
    quantize_modulated_norm,
    remove_norm_fused_forwards,
    w8a8_readers_unfit,
)
from omni_diffusion.quantization.plan import LayerPlan, plan_quantization
from omni_diffusion.quantization.projections import fused_attention, plan_fusion, unfuse_projections
from omni_diffusion.quantization.serialize import load_quantized, save_quantized
from omni_kernels.quant import QuantizedLinear

__all__ = [
    "DEFAULT_SKIP",
    "GELUProjection",
    "LayerPlan",
    "QuantConfig",
    "QuantizedLinear",
    "apply_quantization",
    "class_forward",
    "forget_folded_activations",
    "fused_activations",
    "fused_attention",
    "install_concat_free_forwards",
    "install_norm_fused_forwards",
    "layer_norm_unfit",
    "load_quantized",
    "norm_fused_blocks",
    "normalize_layer_methods",
    "plan_activation_fusion",
    "plan_fusion",
    "plan_quantization",
    "quantize",
    "quantize_modulated_norm",
    "quantized_layers",
    "remove_concat_free_forwards",
    "remove_norm_fused_forwards",
    "save_quantized",
    "unfuse_projections",
    "w8a8_readers_unfit",
]
