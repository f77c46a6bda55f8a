"""Flux.1 (dev, schnell) and Flux.1 Kontext: ``FluxTransformer2DModel``.

* Blocks: 19 dual-stream ``transformer_blocks`` (image and text streams with
  joint attention) then 38 ``single_transformer_blocks`` (in current diffusers
  they take and return both streams, concatenating them inside). Both return
  ``(encoder_hidden_states, hidden_states)``.
* Sequence: joint attention, text tokens first (``ids = cat(txt_ids, img_ids)``);
  Kontext appends the reference image's tokens after the target's.
* CFG: guidance-distilled (the scale is an embedding when
  ``guidance_embeds``); ``true_cfg_scale > 1`` with a negative prompt adds
  separate conditional/unconditional calls.
* Quantization skips the embedders, the final norm/projection and the AdaLN
  modulation linears (one row per sample: nothing to gain, precision to lose).
  It may fuse the attention projections that read one input (``to_q/k/v`` of
  both block kinds, ``add_q/k/v_proj`` of the dual-stream blocks) through
  diffusers' ``fuse_projections()``; diffusers' Flux processors read
  ``fused_projections`` and then call ``to_qkv`` / ``to_added_qkv``. (The
  single-stream blocks' ``proj_mlp`` reads the same input as ``to_q/k/v`` but
  is not fused: under ``torch.compile`` Inductor quantizes that input once for
  both in the kernel that produces it.)
* TeaCache: the first block's ``norm1(hidden_states, emb=temb)`` output, with
  the polynomial TeaCache4FLUX calibrated on FLUX.1-dev (ali-vilab/TeaCache).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from omni_diffusion.adapters import register_adapter
from omni_diffusion.adapters.base import (
    DUAL_SINGLE_STREAM_TP,
    FEED_FORWARD_GELU,
    ActivationFusion,
    BlockCall,
    BlockList,
    CFGInfo,
    ModelAdapter,
    SequenceLayout,
    SequenceParallelPlan,
    modulated_norm_input,
)

#: diffusers' Flux processors that take their projections through ``_get_qkv_projections``,
#: which uses the fused ``to_qkv`` / ``to_added_qkv`` when ``fused_projections`` is set
_FUSION_AWARE_PROCESSORS = ("FluxAttnProcessor", "FluxIPAdapterAttnProcessor")

#: TeaCache4FLUX (FLUX.1-dev), highest power first
FLUX_TEACACHE_COEFFICIENTS = (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01)


def single_block_forward_concat_free(
    self: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``FluxSingleTransformerBlock.forward`` (diffusers >= 0.35, both streams in and out) with
    ``proj_out`` given the attention output and the MLP's input apart
    (``proj_out.forward_concat``): under W8A8 with the GELU folded, the 16-bit
    ``cat([attention, mlp], -1)`` (``[B, S, 3072 + 12288]`` at Flux.1 widths) is never written.

    ``hidden_states`` ``[B, S_img, D]``, ``encoder_hidden_states`` ``[B, S_txt, D]``, ``temb``
    ``[B, D]``; returns ``(encoder_hidden_states, hidden_states)`` of those shapes.
    """
    text_len = encoder_hidden_states.shape[1]
    joint = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    normed, gate = self.norm(joint, emb=temb)
    mlp_input = self.act_mlp(self.proj_mlp(normed))  # the folded GELU is an identity here
    attention = self.attn(hidden_states=normed, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    joint = joint + gate.unsqueeze(1) * self.proj_out.forward_concat(attention, mlp_input)
    if joint.dtype == torch.float16:
        joint = joint.clip(-65504, 65504)
    return joint[:, :text_len], joint[:, text_len:]


@register_adapter
class FluxAdapter(ModelAdapter):
    name = "flux"
    pipeline_classes = ("FluxPipeline", "FluxKontextPipeline")
    transformer_classes = ("FluxTransformer2DModel",)
    block_lists = (
        BlockList("transformer_blocks"),
        BlockList("single_transformer_blocks"),
    )
    layout = SequenceLayout("joint", text_position="first", text_mask=False, image_dims="HW")
    cfg = CFGInfo("distilled", guidance_embedded=True, true_cfg_argument="true_cfg_scale",
                  negative_arguments=("negative_prompt", "negative_prompt_embeds"))
    # The rotary tables span text then image tokens.
    sequence_parallel = SequenceParallelPlan(
        joint_attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
        rotary_arg="image_rotary_emb", rotary_seq_dim=0, rotary_covers_text=True,
    )
    tensor_parallel = DUAL_SINGLE_STREAM_TP
    quant_skip = (
        "x_embedder",
        "context_embedder",
        "time_text_embed.*",
        "norm_out.*",
        "proj_out",
        "transformer_blocks.*.norm1.linear",
        "transformer_blocks.*.norm1_context.linear",
        "single_transformer_blocks.*.norm.linear",
    )
    # The MLP GELUs (dual-stream blocks' ff/ff_context, single blocks' act_mlp) fold into
    # the layers reading them under W8A8 (QuantConfig.fuse_activations).
    activation_fusions = (
        FEED_FORWARD_GELU,
        ActivationFusion("FluxSingleTransformerBlock", activation="act_mlp", consumer="proj_out",
                         concatenated_after="proj_mlp", concat_free_forward=single_block_forward_concat_free),
    )
    fusable_attention = ("transformer_blocks.*.attn", "single_transformer_blocks.*.attn")
    cache_disabling_kwargs = ("controlnet_block_samples", "controlnet_single_block_samples")

    def teacache_input(self, block: nn.Module, call: BlockCall) -> torch.Tensor | None:
        norm = getattr(block, "norm1", None) or getattr(block, "norm", None)
        return None if norm is None else modulated_norm_input(norm, call)

    def teacache_coefficients(self, transformer: nn.Module, pipe: Any = None):
        return FLUX_TEACACHE_COEFFICIENTS

    def tp_packed_sizes(self, transformer: nn.Module, name: str, linear: nn.Module) -> list[int]:
        inner = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        return [inner, linear.in_features - inner]

    def fused_attention_processor(self, module: nn.Module) -> Any:
        processor = getattr(module, "processor", None)
        names = {cls.__name__ for cls in type(processor).__mro__}
        return processor if names & set(_FUSION_AWARE_PROCESSORS) else None
