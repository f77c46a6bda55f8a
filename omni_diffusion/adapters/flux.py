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
  modulation linears (one row per sample: bound by reading their weights, and
  omni's weight-only GEMV does not yet read 8 bits faster than cuBLAS reads 16).
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

import functools
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
    replacement_processor,
    rms_norm_params,
)

#: diffusers' Flux processors that take their projections through ``_get_qkv_projections``,
#: which uses the fused ``to_qkv`` / ``to_added_qkv`` when ``fused_projections`` is set
_FUSION_AWARE_PROCESSORS = ("FluxAttnProcessor", "FluxIPAdapterAttnProcessor")

#: TeaCache4FLUX (FLUX.1-dev), highest power first
FLUX_TEACACHE_COEFFICIENTS = (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01)


@functools.cache
def _flux_fused_norm_rope_processor_class() -> type:
    """diffusers' ``FluxAttnProcessor`` with its QK RMSNorm and rotary embedding as one omni
    kernel (:func:`omni_kernels.qk_norm_rope.qk_rmsnorm_rope`) per stream. Built on first use:
    diffusers is imported only then."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, _get_qkv_projections

    from omni_kernels.qk_norm_rope import qk_rmsnorm_rope

    class FluxAttnProcessorFusedNormRope(FluxAttnProcessor):
        """``FluxAttnProcessor`` whose ``norm_q``/``norm_k`` (and the dual-stream blocks'
        ``norm_added_q``/``norm_added_k``) and rotary embedding run as one omni kernel per
        stream, writing straight into the joint ``[B, S_txt + S_img, H, D]`` query and key
        (diffusers: four norm and two RoPE passes plus a cat; eager RoPE alone is ~10 small
        kernels). The projections, the attention call (same ``_attention_backend`` and
        ``_parallel_config``) and the output projections are diffusers' own. Calls it does
        not cover (no rotary table, norms that are not RMSNorm) go to diffusers' ``__call__``.
        """

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                     image_rotary_emb=None):
            norms = [rms_norm_params(attn.norm_q), rms_norm_params(attn.norm_k)]
            dual = attn.added_kv_proj_dim is not None
            if dual:
                norms += [rms_norm_params(attn.norm_added_q), rms_norm_params(attn.norm_added_k)]
            if image_rotary_emb is None or any(n is None for n in norms) or len({n[1] for n in norms}) != 1:
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask,
                                        image_rotary_emb)
            eps = norms[0][1]
            cos, sin = image_rotary_emb
            query, key, value, text_query, text_key, text_value = _get_qkv_projections(
                attn, hidden_states, encoder_hidden_states)
            query = query.unflatten(-1, (-1, attn.head_dim))
            key = key.unflatten(-1, (-1, attn.head_dim))
            value = value.unflatten(-1, (-1, attn.head_dim))
            if not dual:
                query, key = qk_rmsnorm_rope(query, key, norms[0][0], norms[1][0], cos, sin, eps=eps)
            else:
                text_query = text_query.unflatten(-1, (-1, attn.head_dim))
                text_key = text_key.unflatten(-1, (-1, attn.head_dim))
                text_value = text_value.unflatten(-1, (-1, attn.head_dim))
                batch, text_len, heads, head_dim = text_query.shape
                joint_len = text_len + query.shape[1]
                joint_query = query.new_empty(batch, joint_len, heads, head_dim)
                joint_key = key.new_empty(batch, joint_len, key.shape[2], head_dim)
                cos, sin = cos.reshape(joint_len, head_dim), sin.reshape(joint_len, head_dim)
                # text tokens first, as diffusers concatenates them; each stream its own norm weights
                qk_rmsnorm_rope(text_query, text_key, norms[2][0], norms[3][0], cos[:text_len], sin[:text_len],
                                eps=eps, q_out=joint_query[:, :text_len], k_out=joint_key[:, :text_len])
                qk_rmsnorm_rope(query, key, norms[0][0], norms[1][0], cos[text_len:], sin[text_len:],
                                eps=eps, q_out=joint_query[:, text_len:], k_out=joint_key[:, text_len:])
                query, key = joint_query, joint_key
                value = torch.cat([text_value, value], dim=1)
            hidden_states = dispatch_attention_fn(
                query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
            hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
            if encoder_hidden_states is None:
                return hidden_states
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1)
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
            return hidden_states, attn.to_add_out(encoder_hidden_states.contiguous())

    return FluxAttnProcessorFusedNormRope


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
        # The AdaLN modulation linears (3072 -> 18432 / 9216 on one row per sample) stay bf16:
        # INT8 weight-only through omni's GEMV was slower on the H200 (116 vs 42 us at M=1,
        # 3072 -> 18432; the compiled step 90.9 vs 91.5 ms, eager 108.1 vs 102.0, +3.1 GiB peak:
        # bench/results/pipeline-flux-modulation_nvidia-h200_20261130.md). quant_weight_only
        # takes them once the GEMV reads 8-bit weights faster than cuBLAS reads bf16.
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

    def fused_norm_rope_processor(self, module: nn.Module) -> Any:
        # exactly FluxAttnProcessor: IP-adapter processors keep theirs
        return replacement_processor(module, "FluxAttnProcessor", _flux_fused_norm_rope_processor_class())

    def fused_attention_processor(self, module: nn.Module) -> Any:
        processor = getattr(module, "processor", None)
        names = {cls.__name__ for cls in type(processor).__mro__}
        return processor if names & set(_FUSION_AWARE_PROCESSORS) else None
