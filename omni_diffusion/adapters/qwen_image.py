"""Qwen-Image (and its edit variants, through the transformer class):
``QwenImageTransformer2DModel``.

* Blocks: ``transformer_blocks`` of dual-stream ``QwenImageTransformerBlock``
  returning ``(encoder_hidden_states, hidden_states)``.
* Sequence: joint attention with the text tokens first; the text stream
  carries a padding mask (``encoder_hidden_states_mask``) into attention.
* CFG: ``true_cfg_scale > 1`` with a negative prompt runs separate
  conditional / unconditional calls in ``cache_context``.
* Quantization skips the input projections, the timestep embedder, the final
  norm/projection and the per-block modulation linears (``img_mod``/``txt_mod``).
* TeaCache: the first block's modulated image input (``img_norm1`` then
  ``img_mod``'s first shift/scale); no published calibration (raw distance).
"""

from __future__ import annotations

import torch
from torch import nn

from omni_diffusion.adapters import register_adapter
from omni_diffusion.adapters.base import BlockCall, BlockList, CFGInfo, ModelAdapter, SequenceLayout


@register_adapter
class QwenImageAdapter(ModelAdapter):
    name = "qwen_image"
    pipeline_classes = ("QwenImagePipeline",)
    transformer_classes = ("QwenImageTransformer2DModel",)
    block_lists = (BlockList("transformer_blocks"),)
    layout = SequenceLayout("joint", text_position="first", text_mask=True, image_dims="HW")
    cfg = CFGInfo("separate", true_cfg_argument="true_cfg_scale")
    quant_skip = (
        "img_in",
        "txt_in",
        "time_text_embed.*",
        "norm_out.*",
        "proj_out",
        "transformer_blocks.*.img_mod.*",
        "transformer_blocks.*.txt_mod.*",
    )
    cache_disabling_kwargs = ("controlnet_block_samples",)

    def teacache_input(self, block: nn.Module, call: BlockCall) -> torch.Tensor | None:
        hidden = call.get("hidden_states")
        mod1 = block.img_mod(call.get("temb")).chunk(2, dim=-1)[0]
        modulated, _ = block._modulate(block.img_norm1(hidden), mod1, call.get("modulate_index"))
        return modulated
