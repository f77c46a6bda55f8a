"""The transformers bench/pipeline.py times (and parallel_scaling.py, pipeline_profile.py scale
and profile): full-size FLUX.1-dev and Wan2.1-14B shapes with random weights, tiny copies for
``--smoke``, how each is built and fed, and one forward of it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

if __package__:  # imported as bench.<module> (the tests)
    from bench import shapes as models
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import shapes as models


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    key: str
    name: str
    description: str
    cls_name: str
    config: dict
    forwards_per_step: int
    warmup: int
    iters: int
    #: attention problem the transformer runs: (batch, heads, seq_q, seq_kv, head_dim)
    attention: tuple[int, int, int, int, int]
    #: input sizes: flux: side (packed latent side), text; wan: frames, height, width (latent), text
    sizes: dict = dataclasses.field(default_factory=dict)
    #: the adaLN modulation linears the family's adapter keeps in bf16 (quant_skip); (d8) gives
    #: them INT8 weight-only (omni's Triton GEMV) instead
    modulation_linears: tuple[str, ...] = ()


MODELS = {
    "flux": ModelSpec(
        key="flux",
        name="flux1-dev-1024",
        description="FLUX.1-dev shape, 1024x1024: 4096 image + 512 text tokens, 24 heads x 128, "
                    "19 + 38 blocks, guidance-distilled (1 forward / step)",
        modulation_linears=("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear",
                            "single_transformer_blocks.*.norm.linear"),
        cls_name="FluxTransformer2DModel",
        config=dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                    attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                    pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
        forwards_per_step=1, warmup=3, iters=10,
        attention=models.FLUX.self_attention(),
        sizes=dict(side=64, text=512),  # 1024 px / 8 (VAE) / 2 (2x2 packing)
    ),
    "wan": ModelSpec(
        key="wan",
        name="wan2.1-14b-480p-81f",
        description="Wan2.1-T2V-14B shape, 480x832, 81 frames: 32,760 video tokens, 40 heads x 128, "
                    "40 blocks, 512 text tokens, CFG (2 forwards / step)",
        cls_name="WanTransformer3DModel",
        config=dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
                    in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824,
                    num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                    rope_max_seq_len=1024),
        forwards_per_step=2, warmup=1, iters=3,
        attention=models.WAN_480P.self_attention(),
        sizes=dict(frames=21, height=60, width=104, text=512),
    ),
}

#: ``--smoke``: the same classes a few channels wide, on CPU, to check the script itself
SMOKE_MODELS = {
    "flux": dataclasses.replace(
        MODELS["flux"], name="flux-smoke", description="tiny Flux-shaped transformer (smoke test)",
        config=dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                    pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6)),
        warmup=1, iters=2, attention=(1, 2, 24, 24, 16), sizes=dict(side=4, text=8),
    ),
    "wan": dataclasses.replace(
        MODELS["wan"], name="wan-smoke", description="tiny Wan-shaped transformer (smoke test)",
        config=dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                    in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64,
                    num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                    eps=1e-6, rope_max_seq_len=32),
        warmup=1, iters=2, attention=(1, 2, 8, 8, 16), sizes=dict(frames=2, height=4, width=4, text=8),
    ),
}


# --------------------------------------------------------------------------- models


def build_transformer(spec: ModelSpec, device: torch.device, dtype: torch.dtype):
    import diffusers

    cls = getattr(diffusers, spec.cls_name)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(**spec.config)
    finally:
        torch.set_default_dtype(previous)
    keep = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
    if keep:
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if any(part in keep for part in name.split(".")) and tensor.is_floating_point():
                tensor.data = tensor.data.float()
    return model.eval().requires_grad_(False)


def make_inputs(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(1)
    config, sizes = spec.config, spec.sizes

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    if spec.cls_name == "FluxTransformer2DModel":
        side, text = sizes["side"], sizes["text"]
        rows = torch.arange(side, device=device).repeat_interleave(side)
        cols = torch.arange(side, device=device).repeat(side)
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).to(dtype)
        return dict(
            hidden_states=randn(1, side * side, config["in_channels"]),
            encoder_hidden_states=randn(1, text, config["joint_attention_dim"]),
            pooled_projections=randn(1, config["pooled_projection_dim"]),
            timestep=torch.tensor([0.75], device=device, dtype=dtype),
            guidance=torch.tensor([3.5], device=device, dtype=dtype),
            img_ids=img_ids,
            txt_ids=torch.zeros(text, 3, device=device, dtype=dtype),
            return_dict=False,
        )
    if spec.cls_name == "WanTransformer3DModel":
        return dict(
            hidden_states=randn(1, config["in_channels"], sizes["frames"], sizes["height"], sizes["width"]),
            timestep=torch.tensor([750.0], device=device, dtype=torch.float32),
            encoder_hidden_states=randn(1, sizes["text"], config["text_dim"]),
            return_dict=False,
        )
    raise ValueError(spec.cls_name)


def forward_once(model, inputs):
    """One transformer forward under inference mode; its first output tensor."""
    with torch.inference_mode():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out.sample
