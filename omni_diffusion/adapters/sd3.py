"""Stable Diffusion 3 / 3.5: ``SD3Transformer2DModel`` (MMDiT).

* Blocks: ``transformer_blocks`` of ``JointTransformerBlock``, returning
  ``(encoder_hidden_states, hidden_states)``; the last one is
  ``context_pre_only`` (its text output is None). SD3.5 Medium blocks add a
  second, image-only attention (``attn2``).
* Sequence: joint attention with image tokens first, text last.
* CFG: batched (conditional and unconditional concatenated along the batch,
  one transformer call per step).
* Attention: the SD3 processor (``JointAttnProcessor2_0``) calls torch SDPA
  itself instead of diffusers' dispatcher, so omni swaps it for
  :class:`OmniJointAttnProcessor`: the same projections, norms and
  concatenation, with the attention itself run by
  :func:`omni_kernels.attention.attention` on diffusers' ``[B, S, H, D]``
  layout. Undo puts the original processor objects back.
* Quantization may fuse each attention's ``to_q/k/v`` (and ``add_q/k/v_proj``)
  through diffusers' ``Attention.fuse_projections()``. diffusers' own
  ``FusedJointAttnProcessor2_0`` drops the q/k RMSNorms of SD3.5 and needs text
  tokens, so the fused modules run :class:`OmniJointAttnProcessor`, which reads
  ``fused_projections``; when omni's attention is not installed it runs torch's
  SDPA as ``JointAttnProcessor2_0`` does (``torch_sdpa=True``).
* TeaCache: the first block's ``norm1(hidden_states, emb=temb)``; no published
  calibration (the raw relative L1 distance is accumulated).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
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
    Undo,
    joint_attention_tp,
    modulated_norm_input,
)

_REPLACED_PROCESSORS = ("JointAttnProcessor2_0",)


def _projections(attn: nn.Module, x: torch.Tensor, fused: bool, fused_name: str,
                 names: tuple[str, str, str]) -> tuple[torch.Tensor, ...]:
    """q, k, v ``[B, S, H*D]`` of ``x``: from the fused layer ``fused_name`` (q, k, v in order)
    when the projections are fused, else from the three layers ``names``."""
    if fused:
        return getattr(attn, fused_name)(x).chunk(3, dim=-1)
    return tuple(getattr(attn, name)(x) for name in names)


class OmniJointAttnProcessor:
    """SD3's joint attention with omni's attention kernels.

    ``backend``: an omni backend name, or None to choose per call
    (``omni_kernels.attention``'s context manager / env / ``"auto"``).
    Calls with an attention mask go to the processor it replaced.
    ``parallel``: a callable ``(query, key, value) -> out`` (omni's
    sequence-parallel attention) that replaces the local attention call.
    ``torch_sdpa``: run the attention with torch's ``scaled_dot_product_attention``
    exactly as ``JointAttnProcessor2_0`` does instead of omni's kernels (the
    processor quantization installs when it fuses the projections of a model
    whose attention omni does not run).

    When ``attn.fused_projections`` is set, the projections come from
    ``attn.to_qkv`` / ``attn.to_added_qkv`` (``[B, S, 3*H*D]``, q, k, v in order).
    """

    def __init__(self, backend: str | None, original: Any, parallel: Any = None, *,
                 torch_sdpa: bool = False) -> None:
        self.backend = backend
        self.original = original
        self.parallel = parallel
        self.torch_sdpa = torch_sdpa

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 *args, **kwargs):
        fused = getattr(attn, "fused_projections", False)
        if attention_mask is not None or hidden_states.ndim != 3:
            if fused:
                raise ValueError(
                    "SD3 attention with fused projections (QuantConfig.fuse_projections) takes "
                    f"3-D hidden states and no attention_mask; got {hidden_states.ndim}-D hidden "
                    f"states, attention_mask {'given' if attention_mask is not None else 'None'}. "
                    "Quantize with fuse_projections=False for this use"
                )
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 *args, **kwargs)

        batch, image_len, _ = hidden_states.shape
        heads = attn.heads

        def split(x: torch.Tensor) -> torch.Tensor:  # [B, S, H*D] -> [B, S, H, D]
            return x.view(batch, x.shape[1], heads, -1)

        query, key, value = (split(t) for t in _projections(attn, hidden_states, fused, "to_qkv",
                                                            ("to_q", "to_k", "to_v")))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if encoder_hidden_states is not None:
            c_query, c_key, c_value = (
                split(t) for t in _projections(attn, encoder_hidden_states, fused, "to_added_qkv",
                                               ("add_q_proj", "add_k_proj", "add_v_proj"))
            )
            if attn.norm_added_q is not None:
                c_query = attn.norm_added_q(c_query)
            if attn.norm_added_k is not None:
                c_key = attn.norm_added_k(c_key)
            query = torch.cat([query, c_query], dim=1)
            key = torch.cat([key, c_key], dim=1)
            value = torch.cat([value, c_value], dim=1)

        if self.parallel is not None:
            out = self.parallel(query, key, value)
        elif self.torch_sdpa:  # [B, H, S, D], as JointAttnProcessor2_0
            out = F.scaled_dot_product_attention(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                dropout_p=0.0, is_causal=False,
            ).transpose(1, 2)
        else:
            from omni_kernels.attention import attention

            out = attention(query, key, value, backend=self.backend, layout="bshd")
        out = out.reshape(batch, out.shape[1], -1).to(query.dtype)

        context = None
        if encoder_hidden_states is not None:
            out, context = out[:, :image_len], out[:, image_len:]
            if not attn.context_pre_only:
                context = attn.to_add_out(context)
        out = attn.to_out[0](out)
        out = attn.to_out[1](out)
        if encoder_hidden_states is not None:
            return out, context
        return out


@register_adapter
class SD3Adapter(ModelAdapter):
    name = "sd3"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    transformer_classes = ("SD3Transformer2DModel",)
    block_lists = (BlockList("transformer_blocks"),)
    layout = SequenceLayout("joint", text_position="last", text_mask=False, image_dims="HW")
    cfg = CFGInfo("batched")
    sequence_parallel = SequenceParallelPlan(
        joint_attention=("transformer_blocks.*.attn",),
        image_attention=("transformer_blocks.*.attn2",),  # SD3.5's image-only attention
    )
    tensor_parallel = joint_attention_tp("transformer_blocks", ("ff", "ff_context")).extended(
        colwise=("transformer_blocks.*.attn2.to_[qkv]",),
        rowwise=("transformer_blocks.*.attn2.to_out.0",),
    )
    quant_skip = (
        "pos_embed.*",
        "context_embedder",
        "time_text_embed.*",
        "norm_out.*",
        "proj_out",
        "transformer_blocks.*.norm1.linear",
        "transformer_blocks.*.norm1_context.linear",
    )
    activation_fusions = (FEED_FORWARD_GELU,)
    fusable_attention = ("transformer_blocks.*.attn", "transformer_blocks.*.attn2")
    cache_disabling_kwargs = ("block_controlnet_hidden_states",)

    def apply_attention(self, transformer: nn.Module, omni_backend: str | None) -> Undo:
        swapped: list[tuple[nn.Module, Any]] = []
        # processors quantization installed with fused projections: switched to omni's kernels
        switched: list[OmniJointAttnProcessor] = []
        for module in transformer.modules():
            processor = getattr(module, "processor", None)
            if processor is None or not hasattr(module, "set_processor"):
                continue
            if type(processor).__name__ in _REPLACED_PROCESSORS:
                swapped.append((module, processor))
            elif isinstance(processor, OmniJointAttnProcessor) and processor.torch_sdpa:
                if all(processor is not p for p in switched):
                    switched.append(processor)
        if not swapped and not switched:
            # A diffusers version whose SD3 attention goes through the dispatcher.
            return super().apply_attention(transformer, omni_backend)
        for module, processor in swapped:
            module.set_processor(OmniJointAttnProcessor(omni_backend, processor))
        saved = [(p, p.backend) for p in switched]
        for processor in switched:
            processor.backend, processor.torch_sdpa = omni_backend, False

        def undo() -> None:
            for module, processor in swapped:
                module.set_processor(processor)
            for processor, backend in saved:
                processor.backend, processor.torch_sdpa = backend, True

        return undo

    def fused_attention_processor(self, module: nn.Module) -> Any:
        processor = getattr(module, "processor", None)
        if isinstance(processor, OmniJointAttnProcessor):
            return processor
        if type(processor).__name__ in _REPLACED_PROCESSORS:
            return OmniJointAttnProcessor(None, processor, torch_sdpa=True)
        return None

    def apply_parallel_attention(self, module: nn.Module, parallel: Any) -> Undo:
        processor = module.processor
        if isinstance(processor, OmniJointAttnProcessor):
            previous = processor.parallel
            processor.parallel = parallel

            def undo_parallel() -> None:
                processor.parallel = previous

            return undo_parallel
        if type(processor).__name__ in _REPLACED_PROCESSORS:
            module.set_processor(OmniJointAttnProcessor(parallel.backend, processor, parallel))
            return lambda: module.set_processor(processor)
        return super().apply_parallel_attention(module, parallel)

    def teacache_input(self, block: nn.Module, call: BlockCall) -> torch.Tensor | None:
        return modulated_norm_input(block.norm1, call)
