"""What the quantization tests of tiny diffusers transformers share: the tolerance against the
unquantized model, the fast CPU options, tiny Flux / SD3 / Wan 2.1 / Qwen-Image transformers
with their inputs, the attention modules the adapters declare fusable, and small helpers.

pytest puts this folder on ``sys.path`` for the test modules in it (it has no ``__init__.py``),
so they import this module by its name; the test modules skip without diffusers first.
"""

from __future__ import annotations

import torch
from torch import nn

from omni_diffusion.testing import tiny_flux_transformer


# Relative L2 error of the whole tiny transformer's output against the unquantized float32
# model, with every linear layer quantized (embedders and final projection included, so the
# error is the largest it gets). Measured (seed 0; SD3's is lowest, Qwen-Image's highest):
# FP8 W8A8 0.7-5.0%, INT8 W8A8 0.2-1.0%, FP8 weight-only 0.5-3.8%, INT8 weight-only 0.1-0.6%.
# The bounds leave 2x room: FP8 e4m3 rounds each operand to 3 mantissa bits (up to 2**-4
# relative), INT8 to 1/127 of the row/channel maximum, and the errors of ~20 layers of width
# 32 (few terms to average over) compound through the residual connections.
MODEL_TOLERANCE = {"fp8": 0.10, "int8": 0.02, "fp8_weight_only": 0.08, "int8_weight_only": 0.015}


# Fast CPU paths: torch's CPU kernels for the GEMMs, the reference for activations.
CPU_OPTIONS = dict(backend="aten", activation_backend="torch")


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _tiny_flux():
    return tiny_flux_transformer()


def _tiny_sd3(**config):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(**{
        **dict(sample_size=8, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=16,
               num_attention_heads=2, caption_projection_dim=32, joint_attention_dim=32,
               pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16),
        **config,
    }).eval()
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=gen),
        encoder_hidden_states=torch.randn(1, 6, 32, generator=gen),
        pooled_projections=torch.randn(1, 32, generator=gen),
        timestep=torch.tensor([3.0]),
        return_dict=False,
    )
    return model, inputs


def _tiny_wan():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=64, num_layers=1, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ).eval()
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 2, 8, 8, generator=gen),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 6, 32, generator=gen),
        return_dict=False,
    )
    return model, inputs


def _tiny_qwen_image():
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 4, 4),
    ).eval()
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 16, generator=gen),
        encoder_hidden_states=torch.randn(1, 6, 32, generator=gen),
        encoder_hidden_states_mask=torch.ones(1, 6),
        timestep=torch.tensor([0.5]),
        img_shapes=[(1, 4, 4)],
        return_dict=False,
    )
    return model, inputs


TINY_MODELS = {"flux": _tiny_flux, "sd3": _tiny_sd3, "wan": _tiny_wan, "qwen_image": _tiny_qwen_image}


# The attention modules whose q/k/v (and added q/k/v) the adapters declare fusable.
FUSED_ATTENTION = {
    "flux": ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"],
    "sd3": ["transformer_blocks.0.attn"],
    "sd35": ["transformer_blocks.0.attn", "transformer_blocks.0.attn2", "transformer_blocks.1.attn"],
    "wan": [],
    "qwen_image": [],
}


_TRIPLES = {"to_qkv": ("to_q", "to_k", "to_v"), "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def _linears(model):
    return [name for name, m in model.named_modules() if type(m) is nn.Linear]
