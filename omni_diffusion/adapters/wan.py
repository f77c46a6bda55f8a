"""Wan 2.1 / 2.2, text-to-video and image-to-video: ``WanTransformer3DModel``.

* Denoisers: ``transformer``; Wan 2.2 A14B adds ``transformer_2`` (the
  low-noise expert, used below ``boundary_ratio``). Each is accelerated, and
  each keeps its own cache state.
* Blocks: ``blocks`` of ``WanTransformerBlock(hidden_states,
  encoder_hidden_states, temb, rotary_emb) -> hidden_states``.
* Sequence: image (video) self-attention over the ``F x H x W`` token grid,
  then cross-attention to the text (and, for Wan 2.1 I2V, CLIP image tokens
  prepended to the text).
* CFG: separate conditional / unconditional calls in ``cache_context``.
* Quantization skips the patch embedding, the condition embedders (time,
  text, image) and the output projection; modulation is a parameter table,
  not a linear.
* TeaCache: the projected timestep embedding the blocks receive (``temb``,
  TeaCache4Wan2.1's ``e0``), with its polynomials for Wan 2.1 T2V 1.3B / 14B
  and I2V 14B (480p calibration) and 5 warm-up steps, as calibrated
  (ali-vilab/TeaCache). Wan 2.2 (two experts) has no calibration: raw distance.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from omni_diffusion.adapters.registry import register_adapter
from omni_diffusion.adapters.base import (
    FEED_FORWARD_GELU,
    BlockCall,
    BlockList,
    CFGInfo,
    ModelAdapter,
    SequenceLayout,
    SequenceParallelPlan,
    TensorParallelPlan,
    replacement_processor,
    rms_norm_params,
)

#: TeaCache4Wan2.1 ``e0`` polynomials, highest power first
WAN21_TEACACHE_COEFFICIENTS = {
    "t2v-1.3b": (-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02),
    "t2v-14b": (-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01),
    "i2v-14b-480p": (2.57151496e05, -3.54229917e04, 1.40286849e03, -1.35890334e01, 1.32517977e-01),
    "i2v-14b-720p": (8.10705460e03, 2.13393892e03, -3.72934672e02, 1.66203073e01, -4.17769401e-02),
}


@functools.cache
def _wan_fused_norm_rope_processor_class() -> type:
    """diffusers' ``WanAttnProcessor`` with the self-attention's QK RMSNorm (over all heads) and
    rotary embedding as one omni kernel. Built on first use: diffusers is imported only then."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor, _get_qkv_projections

    from omni_kernels.qk_norm_rope import qk_rmsnorm_rope

    class WanAttnProcessorFusedNormRope(WanAttnProcessor):
        """``WanAttnProcessor`` whose self-attention (``attn1``: rotary, no image context)
        normalizes q and k over all ``H*D`` features and rotates them in one omni kernel
        (:func:`omni_kernels.qk_norm_rope.qk_rmsnorm_rope`, ``norm_across_heads=True``;
        diffusers: two norms, then per tensor a strided unbind, four products and two
        scatter writes). Cross-attention (no rotary table), the I2V image context, sharded
        (tensor-parallel) norms and ``eps=None`` norms go to diffusers' ``__call__``.
        """

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
            norms = (rms_norm_params(attn.norm_q), rms_norm_params(attn.norm_k))
            if (rotary_emb is None or encoder_hidden_states is not None or attn.add_k_proj is not None
                    or None in norms or norms[0][1] != norms[1][1]):
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
            query, key, value = _get_qkv_projections(attn, hidden_states, None)
            query = query.unflatten(2, (attn.heads, -1))
            key = key.unflatten(2, (attn.heads, -1))
            value = value.unflatten(2, (attn.heads, -1))
            cos, sin = rotary_emb
            query, key = qk_rmsnorm_rope(query, key, norms[0][0], norms[1][0], cos, sin, eps=norms[0][1],
                                         interleaved=True, norm_across_heads=True)
            hidden_states = dispatch_attention_fn(
                query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                backend=self._attention_backend, parallel_config=self._parallel_config,
            )
            hidden_states = hidden_states.flatten(2, 3).type_as(query)
            return attn.to_out[1](attn.to_out[0](hidden_states))

    return WanAttnProcessorFusedNormRope


@register_adapter
class WanAdapter(ModelAdapter):
    name = "wan"
    pipeline_classes = ("WanPipeline", "WanImageToVideoPipeline")
    transformer_classes = ("WanTransformer3DModel",)
    transformer_attrs = ("transformer", "transformer_2")
    block_lists = (BlockList("blocks", encoder_arg=None, outputs=("hidden",)),)
    layout = SequenceLayout("cross", text_position=None, text_mask=False, image_dims="FHW")
    cfg = CFGInfo("separate", scale_argument="guidance_scale")
    # Self-attention is sharded; cross-attention (attn2) keeps its replicated text keys.
    sequence_parallel = SequenceParallelPlan(
        image_attention=("blocks.*.attn1",), rotary_arg="rotary_emb", rotary_seq_dim=1,
    )
    tensor_parallel = TensorParallelPlan(
        colwise=("blocks.*.attn[12].to_[qkv]", "blocks.*.attn2.add_[kv]_proj", "blocks.*.ffn.net.0.proj"),
        rowwise=("blocks.*.attn[12].to_out.0", "blocks.*.ffn.net.2"),
        # Wan's q/k RMSNorm spans all heads
        sharded_norms=("blocks.*.attn[12].norm_[qk]", "blocks.*.attn2.norm_added_k"),
    )
    quant_skip = ("patch_embedding", "condition_embedder.*", "proj_out")
    activation_fusions = (FEED_FORWARD_GELU,)
    teacache_warmup_steps = 5

    def teacache_input(self, block: nn.Module, call: BlockCall) -> torch.Tensor | None:
        return call.get("temb")

    def fused_norm_rope_processor(self, module: nn.Module) -> Any:
        return replacement_processor(module, "WanAttnProcessor", _wan_fused_norm_rope_processor_class())

    def teacache_coefficients(self, transformer: nn.Module, pipe: Any = None):
        if pipe is not None and getattr(pipe, "transformer_2", None) is not None:
            return None  # Wan 2.2 A14B: not calibrated
        config = transformer.config
        dim = config.num_attention_heads * config.attention_head_dim
        if dim == 1536 and config.in_channels == 16:
            return WAN21_TEACACHE_COEFFICIENTS["t2v-1.3b"]
        if dim == 5120 and config.in_channels == 16:
            return WAN21_TEACACHE_COEFFICIENTS["t2v-14b"]
        if dim == 5120 and config.in_channels == 36:
            return WAN21_TEACACHE_COEFFICIENTS["i2v-14b-480p"]
        return None
