"""HunyuanVideo: ``HunyuanVideoTransformer3DModel``.

* Blocks: 20 dual-stream ``transformer_blocks`` then 40
  ``single_transformer_blocks``; both take ``(hidden_states,
  encoder_hidden_states, temb, attention_mask, ...)`` positionally and return
  ``(hidden_states, encoder_hidden_states)``.
* Sequence: joint attention with the video tokens first and the text last;
  the text carries a padding mask (a ``[B, 1, 1, S]`` key mask).
* CFG: guidance-distilled (guidance embedding); ``true_cfg_scale > 1`` with a
  negative prompt adds separate calls in ``cache_context``.
* Sequence parallelism (Ulysses, Ring, USP): the video tokens are split over
  the ranks, the text tokens (and the token refiner) replicated; both block kinds
  pass ``[local video, text]`` q/k/v to joint attention. Rotary ``(cos, sin)``,
  each ``[S_video, D]``, is cut to this rank's video tokens. The key mask
  ``[B, 1, 1, S_video + T]`` is cut to ``[local video, text]``; only text keys are
  ever padding. Token-replace conditioning (image-to-video): ``num_tokens`` becomes
  this rank's share of the first frame's tokens.
* Tensor parallelism: Q/K/V, the added text Q/K/V and the first MLP layers
  column-split, output projections and second MLP layers row-split (the single
  blocks' ``proj_out`` over ``[attention, MLP]`` packed); the AdaLN modulation
  linears stay replicated.
* Quantization skips the patch and context embedders (the latter holds the
  text token refiner), the timestep/guidance embedders, the final
  norm/projection and the AdaLN modulation linears.
* TeaCache: the first block's ``norm1(hidden_states, emb=temb)``, with the
  TeaCache4HunyuanVideo polynomial (ali-vilab/TeaCache).
* Fused QK norm + RoPE (``AccelConfig.fused_norm_rope``): both block kinds'
  ``HunyuanVideoAttnProcessor2_0`` is replaced by one that runs the per-head
  RMSNorms and the video tokens' rotary embedding as omni kernels; the token
  refiner's attention (no QK norm, no rotary) keeps diffusers' processor.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from omni_diffusion.adapters.registry import register_adapter
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
    rms_norm_pair,
    single_stream_packed_sizes,
)

#: TeaCache4HunyuanVideo, highest power first
HUNYUAN_VIDEO_TEACACHE_COEFFICIENTS = (
    7.33226126e02, -4.01131952e02, 6.75869174e01, -3.14987800e00, 9.61237896e-02,
)




@functools.cache
def _hunyuan_video_fused_norm_rope_processor_class() -> type:
    """diffusers' ``HunyuanVideoAttnProcessor2_0`` with its QK RMSNorms and rotary embedding
    as omni kernels (:func:`omni_kernels.qk_norm_rope.qk_rmsnorm_rope`). Built on first use:
    diffusers is imported only then."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

    from omni_kernels.qk_norm_rope import qk_rmsnorm_rope

    class HunyuanVideoAttnProcessorFusedNormRope(HunyuanVideoAttnProcessor2_0):
        """``HunyuanVideoAttnProcessor2_0`` whose QK norms and rotary embedding run as two
        omni kernel calls, writing straight into the joint ``[B, S_video + S_text, H, D]``
        query and key (video tokens first, as diffusers orders them):

        * video tokens: ``norm_q``/``norm_k`` then RoPE with the ``(cos, sin)`` tables
          (``[S_video, D]`` each, pairs ``(2i, 2i+1)``);
        * text tokens: normed, not rotated (identity tables ``cos = 1, sin = 0``), with
          ``norm_added_q``/``norm_added_k`` in the dual-stream blocks, and with ``norm_q``/
          ``norm_k`` in the single-stream blocks, whose one ``to_q`` reads ``[video, text]``.

        diffusers: four norm passes, two RoPE passes of ~10 small kernels each, and cats.
        The projections, the attention call (same ``_attention_backend``,
        ``_parallel_config`` and key mask) and the output projections are diffusers' own.
        Calls it does not cover (no rotary table, no text stream, norms that are not
        RMSNorm) go to diffusers' ``__call__``.
        """

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                     image_rotary_emb=None):
            single_stream = attn.add_q_proj is None
            video_norms = rms_norm_pair(attn.norm_q, attn.norm_k)
            text_norms = video_norms if single_stream else rms_norm_pair(attn.norm_added_q, attn.norm_added_k)
            if image_rotary_emb is None or encoder_hidden_states is None or video_norms is None \
                    or text_norms is None:
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask,
                                        image_rotary_emb)
            video_len, text_len = hidden_states.shape[1], encoder_hidden_states.shape[1]
            if single_stream:
                joint = torch.cat([hidden_states, encoder_hidden_states], dim=1)
                query, key, value = (proj(joint).unflatten(2, (attn.heads, -1))
                                     for proj in (attn.to_q, attn.to_k, attn.to_v))
                video_qk = query[:, :video_len], key[:, :video_len]
                text_qk = query[:, video_len:], key[:, video_len:]
            else:
                query, key, value = (proj(hidden_states).unflatten(2, (attn.heads, -1))
                                     for proj in (attn.to_q, attn.to_k, attn.to_v))
                text_query, text_key, text_value = (proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                                                    for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
                video_qk, text_qk = (query, key), (text_query, text_key)
                value = torch.cat([value, text_value], dim=1)
            batch, _, heads, head_dim = query.shape
            joint_query = query.new_empty(batch, video_len + text_len, heads, head_dim)
            joint_key = key.new_empty(batch, video_len + text_len, key.shape[2], head_dim)
            cos, sin = image_rotary_emb
            no_rotation = cos.new_ones(text_len, head_dim), sin.new_zeros(text_len, head_dim)
            for (q, k), (q_weight, k_weight, eps), tables, tokens in (
                (video_qk, video_norms, (cos, sin), slice(None, video_len)),
                (text_qk, text_norms, no_rotation, slice(video_len, None)),
            ):
                qk_rmsnorm_rope(q, k, q_weight, k_weight, *tables, eps=eps, interleaved=True,
                                q_out=joint_query[:, tokens], k_out=joint_key[:, tokens])
            hidden_states = dispatch_attention_fn(
                joint_query, joint_key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                backend=self._attention_backend, parallel_config=self._parallel_config,
            )
            hidden_states = hidden_states.flatten(2, 3).to(joint_query.dtype)
            hidden_states, encoder_hidden_states = hidden_states[:, :video_len], hidden_states[:, video_len:]
            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
            if getattr(attn, "to_add_out", None) is not None:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
            return hidden_states, encoder_hidden_states

    return HunyuanVideoAttnProcessorFusedNormRope


def single_block_forward_concat_free(
    self: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``HunyuanVideoSingleTransformerBlock.forward`` with ``proj_out`` given the attention
    output and the MLP's input apart (``proj_out.forward_concat``): under W8A8 with the GELU
    folded, the 16-bit ``cat([attention, mlp], -1)`` is never written.

    ``hidden_states`` ``[B, S_video, D]``, ``encoder_hidden_states`` ``[B, S_txt, D]`` (text
    after video here), ``temb`` ``[B, D]``; returns ``(hidden_states, encoder_hidden_states)``.
    """
    text_len = encoder_hidden_states.shape[1]
    joint = torch.cat([hidden_states, encoder_hidden_states], dim=1)
    normed, gate = self.norm(joint, emb=temb)
    mlp_input = self.act_mlp(self.proj_mlp(normed))  # the folded GELU is an identity here
    video_attention, text_attention = self.attn(
        hidden_states=normed[:, :-text_len, :],
        encoder_hidden_states=normed[:, -text_len:, :],
        attention_mask=attention_mask,
        image_rotary_emb=image_rotary_emb,
    )
    attention = torch.cat([video_attention, text_attention], dim=1)
    joint = gate.unsqueeze(1) * self.proj_out.forward_concat(attention, mlp_input) + joint
    return joint[:, :-text_len, :], joint[:, -text_len:, :]


@register_adapter
class HunyuanVideoAdapter(ModelAdapter):
    name = "hunyuan_video"
    pipeline_classes = ("HunyuanVideoPipeline",)
    transformer_classes = ("HunyuanVideoTransformer3DModel",)
    block_lists = (
        BlockList("transformer_blocks", outputs=("hidden", "encoder")),
        BlockList("single_transformer_blocks", outputs=("hidden", "encoder")),
    )
    layout = SequenceLayout("joint", text_position="last", text_mask=True, image_dims="FHW")
    cfg = CFGInfo("distilled", guidance_embedded=True, true_cfg_argument="true_cfg_scale",
                  negative_arguments=("negative_prompt", "negative_prompt_embeds"))
    sequence_parallel = SequenceParallelPlan(
        joint_attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
        rotary_arg=("freqs_cis", "image_rotary_emb"), rotary_seq_dim=0,
        mask_arg="attention_mask", mask_seq_dim=-1,
        leading_image_count_args=("num_tokens",),
    )
    # Flux's block layout plus the text token refiner's blocks
    tensor_parallel = DUAL_SINGLE_STREAM_TP.extended(
        colwise=(
            "context_embedder.token_refiner.refiner_blocks.*.attn.to_[qkv]",
            "context_embedder.token_refiner.refiner_blocks.*.ff.net.0.proj",
        ),
        rowwise=(
            "context_embedder.token_refiner.refiner_blocks.*.attn.to_out.0",
            "context_embedder.token_refiner.refiner_blocks.*.ff.net.2",
        ),
    )
    quant_skip = (
        "x_embedder.*",
        "context_embedder.*",
        "time_text_embed.*",
        "norm_out.*",
        "proj_out",
        "transformer_blocks.*.norm1.linear",
        "transformer_blocks.*.norm1_context.linear",
        "single_transformer_blocks.*.norm.linear",
    )
    # Single blocks: proj_out reads cat(attention, GELU(proj_mlp(x))), as in Flux.
    activation_fusions = (
        FEED_FORWARD_GELU,
        ActivationFusion("HunyuanVideoSingleTransformerBlock", activation="act_mlp", consumer="proj_out",
                         concatenated_after="proj_mlp", concat_free_forward=single_block_forward_concat_free),
    )

    def teacache_input(self, block: nn.Module, call: BlockCall) -> torch.Tensor | None:
        norm = getattr(block, "norm1", None) or getattr(block, "norm", None)
        return None if norm is None else modulated_norm_input(norm, call)

    def teacache_coefficients(self, transformer: nn.Module, pipe: Any = None):
        return HUNYUAN_VIDEO_TEACACHE_COEFFICIENTS

    def fused_norm_rope_processor(self, module: nn.Module) -> Any:
        # exactly that class: the token refiner's AttnProcessor2_0 has no QK norm or RoPE
        processor_class = _hunyuan_video_fused_norm_rope_processor_class()
        return replacement_processor(module, "HunyuanVideoAttnProcessor2_0", processor_class)

    def tp_packed_sizes(self, transformer: nn.Module, name: str, linear: nn.Module) -> list[int]:
        return single_stream_packed_sizes(transformer, linear)

    # ------------------------------------------------------------------ LLM prompt stage
    # (omni_diffusion.ar: the Llama text encoder run in vLLM, and the prompt enhancer)

    prompt_enhancer_system_prompt = (
        "You expand prompts for HunyuanVideo, a text-to-video generator. Rewrite the user's "
        "prompt as one detailed paragraph: the main subject and what it does over time, the "
        "objects with their colour, shape, size and texture, the setting, lighting and mood, "
        "and the camera's angle and movement. Keep everything the user asked for and "
        "contradict nothing. Reply with the rewritten prompt only."
    )

    def prompt_format(self, pipe, call_kwargs):
        """What ``HunyuanVideoPipeline._get_llama_prompt_embeds`` does: the call's
        ``prompt_template`` (default: the pipeline's), ``crop_start`` tokens dropped
        (computed as the pipeline does when the template leaves it out),
        ``hidden_states[-(num_hidden_layers_to_skip + 1)]`` (unnormed), truncation and
        padding at ``max_sequence_length`` after the crop."""
        import inspect

        from omni_diffusion.ar.prompt_format import PromptFormat

        defaults = inspect.signature(type(pipe).__call__).parameters
        template = call_kwargs.get("prompt_template") or defaults["prompt_template"].default
        length = call_kwargs.get("max_sequence_length") or defaults["max_sequence_length"].default
        skip = inspect.signature(pipe._get_llama_prompt_embeds).parameters[
            "num_hidden_layers_to_skip"].default
        crop = template.get("crop_start")
        if crop is None:  # the pipeline's own rule, kept as it is
            ids = pipe.tokenizer(template["template"], padding="max_length", return_tensors="pt")
            crop = ids["input_ids"].shape[-1] - 2
        return PromptFormat(template["template"], drop_tokens=crop, hidden_layer=-(skip + 1),
                            max_tokens=length + crop, pad_to=length)

    def llm_text_decoder(self, pipe):
        """The text encoder is a ``LlamaModel``: its weights under a ``LlamaForCausalLM``."""
        return pipe.text_encoder, pipe.text_encoder.config, "LlamaForCausalLM"

    def prompt_embeds_kwargs(self, pipe, kwargs, positive, negative):
        """The call's arguments with the Llama embeddings and masks in place of the prompts.

        The pooled CLIP embeddings (``text_encoder_2``, small) are still computed
        here from ``prompt`` as ``encode_prompt`` does (it reads ``prompt``, not
        ``prompt_2``), since the pipeline refuses prompts next to embeddings.
        Given embeddings are not repeated per video by the pipeline, so that is
        done here and ``num_videos_per_prompt`` becomes 1 (same latents).
        """
        kwargs = dict(kwargs)
        per_prompt = kwargs.pop("num_videos_per_prompt", None) or 1
        kwargs["num_videos_per_prompt"] = 1
        device = pipe._execution_device

        def fill(prefix: str, texts, encoded) -> None:
            embeds, mask = encoded
            with torch.no_grad():
                pooled = pipe._get_clip_prompt_embeds(texts, 1, device=device, max_sequence_length=77)
            kwargs[f"{prefix}prompt_embeds"] = embeds.repeat_interleave(per_prompt, dim=0)
            kwargs[f"{prefix}prompt_attention_mask"] = mask.repeat_interleave(per_prompt, dim=0)
            kwargs[f"{prefix}pooled_prompt_embeds"] = pooled.repeat_interleave(per_prompt, dim=0)

        prompt = kwargs.pop("prompt")
        kwargs.pop("prompt_2", None)
        fill("", [prompt] if isinstance(prompt, str) else list(prompt), positive)
        negative_prompt = kwargs.pop("negative_prompt", None)
        kwargs.pop("negative_prompt_2", None)
        if negative is not None:
            texts = [negative_prompt] if isinstance(negative_prompt, str) else list(negative_prompt)
            fill("negative_", texts, negative)
        return kwargs
