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
  the ranks, the text tokens are replicated (every rank runs the whole text
  stream). The processor concatenates text then image q/k/v, so joint
  attention sees ``[text, local image]``. Rotary comes as a pair
  ``(image_freqs [S_image, D/2], text_freqs [T, D/2])`` (complex): the image
  table is cut to this rank's tokens, the text table passes whole. The text
  padding mask (``encoder_hidden_states_mask``, ``[B, T]``) is replicated and
  reaches the processor unchanged; the processor builds the joint key mask
  ``[B, 1, 1, T + n_local]`` with the local image keys all True, and
  sequence-parallel attention applies its text part to the text keys (in the
  local Ring step, the one holding them). ``modulate_index`` (``[B, S_image]``,
  Qwen-Image-Edit-2511's per-token modulation choice) is cut like the image tokens.
* Tensor parallelism: Q/K/V of both streams and the first MLP layers of both
  streams column-split, the two output projections and second MLP layers
  row-split (one all-reduce each); the per-head q/k RMSNorms need nothing. The
  processor derives the head size as ``inner_dim // heads``, both of which
  tensor parallelism divides. The modulation linears stay replicated.
* Quantization skips the input projections, the timestep embedder, the final
  norm/projection and the per-block modulation linears (``img_mod``/``txt_mod``).
* TeaCache: the first block's modulated image input (``img_norm1`` then
  ``img_mod``'s first shift/scale); no published calibration (raw distance).
"""

from __future__ import annotations

import torch
from torch import nn

from omni_diffusion.adapters import register_adapter
from omni_diffusion.adapters.base import (
    FEED_FORWARD_GELU,
    BlockCall,
    BlockList,
    CFGInfo,
    ModelAdapter,
    SequenceLayout,
    SequenceParallelPlan,
    TensorParallelPlan,
)


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
    tensor_parallel = TensorParallelPlan(
        colwise=(
            "transformer_blocks.*.attn.to_[qkv]",
            "transformer_blocks.*.attn.add_[qkv]_proj",
            "transformer_blocks.*.img_mlp.net.0.proj",
            "transformer_blocks.*.txt_mlp.net.0.proj",
        ),
        rowwise=(
            "transformer_blocks.*.attn.to_out.0",
            "transformer_blocks.*.attn.to_add_out",
            "transformer_blocks.*.img_mlp.net.2",
            "transformer_blocks.*.txt_mlp.net.2",
        ),
    )
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
