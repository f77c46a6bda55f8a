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
  modulation linears (one row per sample: bound by reading their weights). It may
  fuse ``to_q/k/v`` (and ``add_q/k/v_proj``) through diffusers' ``fuse_projections()``;
  diffusers' Flux processors read ``fused_projections``. (``proj_mlp`` reads the same
  input but is not fused: under ``torch.compile`` Inductor quantizes it once for both.)
* Norm fusion (W8A8, ``QuantConfig.fuse_norms``): both block kinds get a forward that
  quantizes each LayerNorm + adaLN output once for all the projections reading it (no
  16-bit joint cat in the single blocks); without the fused attention processor
  (``attend_projected``) it falls back to the block's own forward.
* TeaCache: the first block's ``norm1(hidden_states, emb=temb)`` output, with
  the polynomial TeaCache4FLUX calibrated on FLUX.1-dev (ali-vilab/TeaCache).
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
    NormFusion,
    SequenceLayout,
    SequenceParallelPlan,
    modulated_norm_input,
    replacement_processor,
    rms_norm_params,
    single_stream_packed_sizes,
)
from omni_diffusion.quantization.norm_fusion import (
    class_forward,
    layer_norm_unfit,
    quantize_modulated_norm,
    w8a8_readers_unfit,
)

#: diffusers' Flux processors that take their projections through ``_get_qkv_projections``,
#: which uses the fused ``to_qkv`` / ``to_added_qkv`` when ``fused_projections`` is set
_FUSION_AWARE_PROCESSORS = ("FluxAttnProcessor", "FluxIPAdapterAttnProcessor")

#: TeaCache4FLUX (FLUX.1-dev), highest power first
FLUX_TEACACHE_COEFFICIENTS = (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01)


def attention_norms_fit(attn: nn.Module) -> bool:
    """Whether the fused processor's one QK-norm + RoPE kernel covers ``attn``'s norms: RMSNorms
    (the dual-stream blocks' text-stream ones too) sharing one eps."""
    norms = [rms_norm_params(attn.norm_q), rms_norm_params(attn.norm_k)]
    if attn.added_kv_proj_dim is not None:
        norms += [rms_norm_params(getattr(attn, "norm_added_q", None)),
                  rms_norm_params(getattr(attn, "norm_added_k", None))]
    return all(n is not None for n in norms) and len({n[1] for n in norms}) == 1


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
            if image_rotary_emb is None or not attention_norms_fit(attn):
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask,
                                        image_rotary_emb)
            projections = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
            return self.attend_projected(attn, *projections, image_rotary_emb, attention_mask)

        def attend_projected(self, attn, query, key, value, text_query, text_key, text_value,
                             image_rotary_emb, attention_mask=None):
            """This processor's call from the q/k/v projections on: ``query``/``key``/``value``
            ``[B, S_img, H * D]`` (the single-stream blocks: the joint sequence), and for the
            dual-stream blocks ``text_query``/``text_key``/``text_value`` ``[B, S_txt, H * D]``
            (``None``, or diffusers' ``(None,)`` placeholders, for the single-stream ones).
            ``image_rotary_emb`` ``(cos, sin)`` ``[S_txt + S_img, D]`` is required, and the
            module's norms must be what :func:`attention_norms_fit` accepts. Returns what
            ``__call__`` returns: ``[B, S, H * D]``, or for the dual-stream blocks
            ``(image output, text output)`` after ``to_out`` / ``to_add_out``."""
            norms = [rms_norm_params(attn.norm_q), rms_norm_params(attn.norm_k)]
            dual = attn.added_kv_proj_dim is not None
            if dual:
                norms += [rms_norm_params(attn.norm_added_q), rms_norm_params(attn.norm_added_k)]
            eps = norms[0][1]
            cos, sin = image_rotary_emb
            query = query.unflatten(-1, (-1, attn.head_dim))
            key = key.unflatten(-1, (-1, attn.head_dim))
            value = value.unflatten(-1, (-1, attn.head_dim))
            text_len = None
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
            if text_len is None:
                return hidden_states
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [text_len, hidden_states.shape[1] - text_len], dim=1)
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
    joint = joint + gate.unsqueeze(1) * _proj_out(self.proj_out, attention, mlp_input)
    if joint.dtype == torch.float16:
        joint = joint.clip(-65504, 65504)
    return joint[:, :text_len], joint[:, text_len:]


def _quantized_projections(attn: nn.Module, fused: str, separate: tuple[str, str, str], x_q, x_scale, dtype):
    """q, k, v ``[B, S, H * D]`` of ``attn`` from a quantized input: its fused layer when diffusers'
    ``fused_projections`` is set (as ``_get_qkv_projections`` decides), else the three."""
    if attn.fused_projections:
        return getattr(attn, fused).forward_quantized(x_q, x_scale, dtype).chunk(3, dim=-1)
    return tuple(getattr(attn, name).forward_quantized(x_q, x_scale, dtype) for name in separate)


def _projection_layers(attn: nn.Module, fused: str, separate: tuple[str, str, str]) -> list[nn.Module | None]:
    return [getattr(attn, fused, None)] if attn.fused_projections else [getattr(attn, n, None) for n in separate]


def _feed_forward_quantized(ff: nn.Module, x_q: torch.Tensor, x_scale: torch.Tensor, dtype) -> torch.Tensor:
    """diffusers' ``FeedForward`` (``net = [GELU(proj), Dropout, Linear]``) on a quantized input:
    ``net[0].proj`` reads it, then ``net[0]``'s GELU unless quantization folded it into
    ``net[2]`` (``GELUProjection``), then the rest of ``net``."""
    projection = ff.net[0]
    hidden = projection.proj.forward_quantized(x_q, x_scale, dtype)
    if type(projection).__name__ != "GELUProjection":
        hidden = projection.gelu(hidden)
    for module in ff.net[1:]:
        hidden = module(hidden)
    return hidden


def _feed_forward_unfit(ff: nn.Module | None) -> str | None:
    net = getattr(ff, "net", None)
    first = net[0] if isinstance(net, nn.ModuleList) and len(net) else None
    if type(first).__name__ not in ("GELU", "GELUProjection"):
        return f"its feed-forward starts with a {type(first).__name__}, not diffusers' GELU(proj)"
    return w8a8_readers_unfit(first.proj)


def _ada_norm_zero_unfit(norm: nn.Module | None, chunks: int, dim: int) -> str | None:
    """Why ``norm`` is not an ``AdaLayerNormZero``/``...Single`` (``linear(silu(emb))`` split into
    ``chunks`` tables of ``dim``, then a LayerNorm) whose parts the fused forwards take apart."""
    if getattr(norm, "emb", None) is not None:
        return "its AdaLayerNormZero embeds the timestep itself"
    linear, silu = getattr(norm, "linear", None), getattr(norm, "silu", None)
    if not isinstance(silu, nn.SiLU) or getattr(linear, "out_features", None) != chunks * dim:
        return f"{type(norm).__name__} is not silu + linear(-> {chunks} x {dim}) + norm"
    return layer_norm_unfit(getattr(norm, "norm", None))


def dual_block_unfit(block: nn.Module) -> str | None:
    """Why a ``FluxTransformerBlock`` cannot take :func:`dual_block_forward_norm_fused`, or ``None``."""
    attn = block.attn
    dim = attn.query_dim
    return (
        _ada_norm_zero_unfit(block.norm1, 6, dim)
        or _ada_norm_zero_unfit(block.norm1_context, 6, dim)
        or layer_norm_unfit(block.norm2)
        or layer_norm_unfit(block.norm2_context)
        or (None if attention_norms_fit(attn) else "its attention's QK norms are not RMSNorms with one eps")
        or w8a8_readers_unfit(*_projection_layers(attn, "to_qkv", ("to_q", "to_k", "to_v")))
        or w8a8_readers_unfit(*_projection_layers(attn, "to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj")))
        or _feed_forward_unfit(block.ff)
        or _feed_forward_unfit(block.ff_context)
    )


def single_block_unfit(block: nn.Module) -> str | None:
    """Why a ``FluxSingleTransformerBlock`` cannot take :func:`single_block_forward_norm_fused`."""
    attn = block.attn
    return (
        _ada_norm_zero_unfit(block.norm, 3, attn.query_dim)
        or (None if attention_norms_fit(attn) else "its attention's QK norms are not RMSNorms with one eps")
        or w8a8_readers_unfit(*_projection_layers(attn, "to_qkv", ("to_q", "to_k", "to_v")), block.proj_mlp)
    )


def _attends_projected(block: nn.Module, image_rotary_emb, joint_attention_kwargs) -> bool:
    # IP-adapter kwargs, a missing rotary table or another processor: the 16-bit path
    return (image_rotary_emb is not None and not joint_attention_kwargs
            and hasattr(block.attn.processor, "attend_projected"))


def dual_block_forward_norm_fused(
    self: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``FluxTransformerBlock.forward`` with its four LayerNorm + adaLN outputs (image and text
    streams, before attention and before the MLP) quantized once each in omni's fused kernel
    (:func:`~omni_diffusion.quantization.quantize_modulated_norm`) and read by the W8A8
    projections as they are: no 16-bit modulated copy, no separate quantization pass.

    ``hidden_states`` ``[B, S_img, D]``, ``encoder_hidden_states`` ``[B, S_txt, D]``, ``temb``
    ``[B, D]``; returns ``(encoder_hidden_states, hidden_states)``. Calls with
    ``joint_attention_kwargs`` (IP-adapter), without a rotary table or whose attention
    processor is not omni's fused one go to the class forward.
    """
    if not _attends_projected(self, image_rotary_emb, joint_attention_kwargs):
        return class_forward(self)(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                   joint_attention_kwargs)
    attn, dtype = self.attn, hidden_states.dtype
    shift, scale, gate, mlp_shift, mlp_scale, mlp_gate = self.norm1.linear(self.norm1.silu(temb)).chunk(6, dim=1)
    (text_shift, text_scale, text_gate, text_mlp_shift, text_mlp_scale,
     text_mlp_gate) = self.norm1_context.linear(self.norm1_context.silu(temb)).chunk(6, dim=1)

    projections = _quantized_projections(
        attn, "to_qkv", ("to_q", "to_k", "to_v"),
        *quantize_modulated_norm(hidden_states, self.norm1.norm, shift, scale,
                                 _projection_layers(attn, "to_qkv", ("to_q", "to_k", "to_v"))[0]), dtype)
    text_projections = _quantized_projections(
        attn, "to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj"),
        *quantize_modulated_norm(encoder_hidden_states, self.norm1_context.norm, text_shift, text_scale,
                                 _projection_layers(attn, "to_added_qkv", ("add_q_proj", "add_k_proj",
                                                                           "add_v_proj"))[0]), dtype)
    attn_output, text_attn_output = attn.processor.attend_projected(
        attn, *projections, *text_projections, image_rotary_emb)

    hidden_states = hidden_states + gate.unsqueeze(1) * attn_output
    mlp_input = quantize_modulated_norm(hidden_states, self.norm2, mlp_shift, mlp_scale, self.ff.net[0].proj)
    hidden_states = hidden_states + mlp_gate.unsqueeze(1) * _feed_forward_quantized(self.ff, *mlp_input, dtype)

    encoder_hidden_states = encoder_hidden_states + text_gate.unsqueeze(1) * text_attn_output
    text_mlp_input = quantize_modulated_norm(encoder_hidden_states, self.norm2_context, text_mlp_shift,
                                             text_mlp_scale, self.ff_context.net[0].proj)
    encoder_hidden_states = encoder_hidden_states + text_mlp_gate.unsqueeze(1) * _feed_forward_quantized(
        self.ff_context, *text_mlp_input, dtype)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def single_block_forward_norm_fused(
    self: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``FluxSingleTransformerBlock.forward`` with the LayerNorm + adaLN output quantized once in
    omni's fused kernel and read, 8-bit, by both the q/k/v projections and ``proj_mlp``; and, as
    :func:`single_block_forward_concat_free`, ``proj_out`` reading the attention output and the
    MLP input apart. The joint sequence is never concatenated in 16 bits: the quantization reads
    the text and image streams in place (text first, as diffusers concatenates them) and the
    residual is added to each stream apart. Shapes as there. Calls with
    ``joint_attention_kwargs``, without a rotary table or whose processor is not omni's fused one
    run :func:`single_block_forward_concat_free`.
    """
    if not _attends_projected(self, image_rotary_emb, joint_attention_kwargs):
        return single_block_forward_concat_free(self, hidden_states, encoder_hidden_states, temb,
                                                image_rotary_emb, joint_attention_kwargs)
    attn, dtype = self.attn, hidden_states.dtype
    text_len = encoder_hidden_states.shape[1]
    shift, scale, gate = self.norm.linear(self.norm.silu(temb)).chunk(3, dim=1)
    x_q, x_scale = quantize_modulated_norm(hidden_states, self.norm.norm, shift, scale, self.proj_mlp,
                                           prefix=encoder_hidden_states)
    mlp_input = self.act_mlp(self.proj_mlp.forward_quantized(x_q, x_scale, dtype))  # identity when folded
    query, key, value = _quantized_projections(attn, "to_qkv", ("to_q", "to_k", "to_v"), x_q, x_scale, dtype)
    attention = attn.processor.attend_projected(attn, query, key, value, None, None, None, image_rotary_emb)
    update = gate.unsqueeze(1) * _proj_out(self.proj_out, attention, mlp_input)
    encoder_hidden_states = encoder_hidden_states + update[:, :text_len]
    hidden_states = hidden_states + update[:, text_len:]
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _proj_out(proj_out: nn.Module, attention: torch.Tensor, mlp_input: torch.Tensor) -> torch.Tensor:
    concat = getattr(proj_out, "forward_concat", None)
    return concat(attention, mlp_input) if concat is not None else proj_out(torch.cat([attention, mlp_input], -1))


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
        # INT8 weight-only through omni's GEMV measured slower than cuBLAS in bf16 (see
        # bench/results/INDEX.md). quant_weight_only takes them once the GEMV is faster.
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
    # The blocks' LayerNorm + adaLN outputs are quantized once, in omni's fused kernel, for the
    # W8A8 projections reading them (QuantConfig.fuse_norms).
    norm_fusions = (
        NormFusion("FluxTransformerBlock", dual_block_forward_norm_fused, dual_block_unfit),
        NormFusion("FluxSingleTransformerBlock", single_block_forward_norm_fused, single_block_unfit),
    )
    fusable_attention = ("transformer_blocks.*.attn", "single_transformer_blocks.*.attn")
    cache_disabling_kwargs = ("controlnet_block_samples", "controlnet_single_block_samples")

    def teacache_input(self, block: nn.Module, call: BlockCall) -> torch.Tensor | None:
        norm = getattr(block, "norm1", None) or getattr(block, "norm", None)
        return None if norm is None else modulated_norm_input(norm, call)

    def teacache_coefficients(self, transformer: nn.Module, pipe: Any = None):
        return FLUX_TEACACHE_COEFFICIENTS

    def tp_packed_sizes(self, transformer: nn.Module, name: str, linear: nn.Module) -> list[int]:
        return single_stream_packed_sizes(transformer, linear)

    def fused_norm_rope_processor(self, module: nn.Module) -> Any:
        # exactly FluxAttnProcessor: IP-adapter processors keep theirs
        return replacement_processor(module, "FluxAttnProcessor", _flux_fused_norm_rope_processor_class())

    def fused_attention_processor(self, module: nn.Module) -> Any:
        processor = getattr(module, "processor", None)
        names = {cls.__name__ for cls in type(processor).__mro__}
        return processor if names & set(_FUSION_AWARE_PROCESSORS) else None
