"""Qwen-Image (and its edit variants, through the transformer class):
``QwenImageTransformer2DModel``.

* Blocks: ``transformer_blocks`` of dual-stream ``QwenImageTransformerBlock``
  returning ``(encoder_hidden_states, hidden_states)``.
* Sequence: joint attention with the text tokens first; the text stream
  carries a padding mask (``encoder_hidden_states_mask``) into attention.
* CFG: ``true_cfg_scale > 1`` with a negative prompt runs separate
  conditional / unconditional calls in ``cache_context`` (the negative prompt
  is encoded to its own length: the two calls' text lengths may differ, which
  CFG parallelism allows).
* Sequence parallelism (Ulysses, Ring, USP): the image tokens are split over
  the ranks, the text tokens replicated; joint attention sees ``[text, local image]``.
  Rotary ``(image_freqs [S_image, D/2], text_freqs [T, D/2])``: the image table is
  cut to this rank's tokens. The text padding mask ``[B, T]`` is replicated; the
  processor's joint key mask ``[B, 1, 1, T + n_local]`` has the image keys all True.
  ``modulate_index`` ``[B, S_image]`` (Qwen-Image-Edit-2511) is cut like the image tokens.
* Tensor parallelism: Q/K/V and the first MLP layers of both streams column-split,
  output projections and second MLP layers row-split (one all-reduce each); the
  modulation linears stay replicated.
* Quantization skips the input projections, the timestep embedder, the final
  norm/projection and the per-block modulation linears (``img_mod``/``txt_mod``).
* TeaCache: the first block's modulated image input (``img_norm1`` then
  ``img_mod``'s first shift/scale); no published calibration (raw distance).
* Fused QK norm + RoPE (``AccelConfig.fused_norm_rope``):
  ``QwenDoubleStreamAttnProcessor2_0`` is replaced by one that runs each stream's
  per-head RMSNorms and complex rotary embedding as one omni kernel.
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
    joint_attention_tp,
    replacement_processor,
    rms_norm_pair,
)




def rotary_tables_from_complex(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[S, D]`` (float32 for complex64), from Qwen-Image's complex rotary
    ``freqs`` ``[S, D/2]``: ``apply_rotary_emb_qwen(x, freqs, use_real=False)`` reads pairs
    ``(x[2i], x[2i+1])`` as complex numbers and multiplies them by ``freqs[:, i]``, which is
    ``qk_rmsnorm_rope(..., interleaved=True)`` with each angle's cos and sin repeated for both
    members of its pair."""
    cos_sin = torch.view_as_real(freqs)  # [S, D/2, (real, imaginary)]
    return cos_sin[..., 0].repeat_interleave(2, dim=-1), cos_sin[..., 1].repeat_interleave(2, dim=-1)


@functools.cache
def _qwen_fused_norm_rope_processor_class() -> type:
    """diffusers' ``QwenDoubleStreamAttnProcessor2_0`` with its QK RMSNorms and rotary
    embedding as one omni kernel (:func:`omni_kernels.qk_norm_rope.qk_rmsnorm_rope`) per
    stream. Built on first use: diffusers is imported only then."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    from omni_kernels.qk_norm_rope import qk_rmsnorm_rope

    class QwenDoubleStreamAttnProcessorFusedNormRope(QwenDoubleStreamAttnProcessor2_0):
        """``QwenDoubleStreamAttnProcessor2_0`` whose ``norm_q``/``norm_k`` (image stream),
        ``norm_added_q``/``norm_added_k`` (text stream) and rotary embedding run as one omni
        kernel per stream, writing straight into the joint ``[B, S_text + S_image, H, D]``
        query and key (text first, as diffusers orders them). Each stream's complex
        ``[S, D/2]`` rotary table becomes the kernel's ``[S, D]`` cos/sin tables once per call
        (:func:`rotary_tables_from_complex`). The text padding mask (the joint key mask
        built as diffusers builds it), the projections, the attention call (same
        ``_attention_backend`` and ``_parallel_config``) and the output projections are
        diffusers' own. Calls it does not cover (no rotary table, a real-valued one, norms
        that are not RMSNorm, the arguments diffusers refuses) go to diffusers' ``__call__``.
        """

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                     attention_mask=None, image_rotary_emb=None):
            image_norms = rms_norm_pair(attn.norm_q, attn.norm_k)
            text_norms = rms_norm_pair(attn.norm_added_q, attn.norm_added_k)
            if encoder_hidden_states is None or attention_mask is not None or image_rotary_emb is None \
                    or image_norms is None or text_norms is None \
                    or not all(torch.is_complex(freqs) for freqs in image_rotary_emb):
                return super().__call__(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                        attention_mask, image_rotary_emb)
            if encoder_hidden_states_mask is not None:  # text padding, then every image key
                image_mask = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
                attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
            # a fixed head size, the head count from the width: tensor parallelism's sharded heads
            head_dim = attn.inner_dim // attn.heads
            image_query, image_key, image_value = (proj(hidden_states).unflatten(-1, (-1, head_dim))
                                                   for proj in (attn.to_q, attn.to_k, attn.to_v))
            text_query, text_key, text_value = (proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
                                                for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            batch, text_len = text_query.shape[:2]
            joint_len = text_len + image_query.shape[1]
            joint_query = image_query.new_empty(batch, joint_len, image_query.shape[2], head_dim)
            joint_key = image_key.new_empty(batch, joint_len, image_key.shape[2], head_dim)
            image_freqs, text_freqs = image_rotary_emb
            for (q, k), (q_weight, k_weight, eps), freqs, tokens in (
                ((text_query, text_key), text_norms, text_freqs, slice(None, text_len)),
                ((image_query, image_key), image_norms, image_freqs, slice(text_len, None)),
            ):
                qk_rmsnorm_rope(q, k, q_weight, k_weight, *rotary_tables_from_complex(freqs), eps=eps,
                                interleaved=True, q_out=joint_query[:, tokens], k_out=joint_key[:, tokens])
            joint_value = torch.cat([text_value, image_value], dim=1)
            hidden_states = dispatch_attention_fn(
                joint_query, joint_key, joint_value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                backend=self._attention_backend, parallel_config=self._parallel_config,
            )
            hidden_states = hidden_states.flatten(2, 3).to(joint_query.dtype)
            text_output, image_output = hidden_states[:, :text_len], hidden_states[:, text_len:]
            image_output = attn.to_out[0](image_output.contiguous())
            if len(attn.to_out) > 1:
                image_output = attn.to_out[1](image_output)  # dropout
            return image_output, attn.to_add_out(text_output.contiguous())

    return QwenDoubleStreamAttnProcessorFusedNormRope


@register_adapter
class QwenImageAdapter(ModelAdapter):
    name = "qwen_image"
    pipeline_classes = ("QwenImagePipeline",)
    transformer_classes = ("QwenImageTransformer2DModel",)
    block_lists = (BlockList("transformer_blocks"),)
    layout = SequenceLayout("joint", text_position="first", text_mask=True, image_dims="HW")
    cfg = CFGInfo("separate", true_cfg_argument="true_cfg_scale",
                  negative_arguments=("negative_prompt", "negative_prompt_embeds"))
    sequence_parallel = SequenceParallelPlan(
        joint_attention=("transformer_blocks.*.attn",),
        rotary_arg="image_rotary_emb", rotary_seq_dim=0, rotary_text_entries=(1,),
        image_token_args=("modulate_index",),
    )
    tensor_parallel = joint_attention_tp("transformer_blocks", ("img_mlp", "txt_mlp"))
    quant_skip = (
        "img_in",
        "txt_in",
        "time_text_embed.*",
        "norm_out.*",
        "proj_out",
        "transformer_blocks.*.img_mod.*",
        "transformer_blocks.*.txt_mod.*",
    )
    activation_fusions = (FEED_FORWARD_GELU,)
    cache_disabling_kwargs = ("controlnet_block_samples",)

    def fused_norm_rope_processor(self, module: nn.Module) -> Any:
        processor_class = _qwen_fused_norm_rope_processor_class()
        return replacement_processor(module, "QwenDoubleStreamAttnProcessor2_0", processor_class)

    def teacache_input(self, block: nn.Module, call: BlockCall) -> torch.Tensor | None:
        hidden = call.get("hidden_states")
        mod1 = block.img_mod(call.get("temb")).chunk(2, dim=-1)[0]
        modulated, _ = block._modulate(block.img_norm1(hidden), mod1, call.get("modulate_index"))
        return modulated

    # ------------------------------------------------------------------ LLM prompt stage
    # (omni_diffusion.ar: the text encoder run in vLLM, and the prompt enhancer)

    prompt_enhancer_system_prompt = (
        "You expand prompts for Qwen-Image, an image generator that renders text well. Rewrite "
        "the user's prompt as one detailed paragraph: the subjects and their appearance, "
        "positions and relations, the background, lighting, colours, style and camera view. "
        "Quote any text that must appear in the image exactly as given. Keep everything the "
        "user asked for and contradict nothing. Reply with the rewritten prompt only."
    )

    def prompt_format(self, pipe, call_kwargs):
        """What ``QwenImagePipeline._get_qwen_prompt_embeds`` does: the pipeline's
        ``prompt_template_encode``, its first ``prompt_template_encode_start_idx``
        tokens dropped, the last (normed) hidden layer, truncation at
        ``tokenizer_max_length`` plus the dropped tokens, padding to the longest prompt."""
        from omni_diffusion.ar.prompt_format import PromptFormat

        drop = pipe.prompt_template_encode_start_idx
        return PromptFormat(pipe.prompt_template_encode, drop_tokens=drop, hidden_layer=-1,
                            max_tokens=pipe.tokenizer_max_length + drop)

    def llm_text_decoder(self, pipe):
        """Qwen2.5-VL's text decoder as a ``Qwen2ForCausalLM`` (same weights; for text-only
        input its 3-axis rotary positions are equal, which makes them plain rotary ones)."""
        from transformers import Qwen2Config

        encoder = pipe.text_encoder
        decoder = getattr(encoder.model, "language_model", encoder.model)
        text = encoder.config.get_text_config()
        rope = getattr(text, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(text, "rope_theta", None))
        config = Qwen2Config(
            vocab_size=text.vocab_size, hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size, num_hidden_layers=text.num_hidden_layers,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=text.num_key_value_heads, hidden_act=text.hidden_act,
            max_position_embeddings=text.max_position_embeddings, rms_norm_eps=text.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": theta},
            use_sliding_window=False, tie_word_embeddings=True,
        )
        return decoder, config, "Qwen2ForCausalLM"

    def prompt_embeds_kwargs(self, pipe, kwargs, positive, negative):
        """The call's arguments with ``(embeds, mask)`` in place of the prompts
        (``encode_prompt`` still repeats them per image and drops an all-ones mask)."""
        kwargs = dict(kwargs)
        kwargs.pop("prompt", None)
        kwargs.pop("negative_prompt", None)
        kwargs["prompt_embeds"], kwargs["prompt_embeds_mask"] = positive
        if negative is not None:
            kwargs["negative_prompt_embeds"], kwargs["negative_prompt_embeds_mask"] = negative
        return kwargs
