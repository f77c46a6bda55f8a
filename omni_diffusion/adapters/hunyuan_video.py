"""HunyuanVideo: ``HunyuanVideoTransformer3DModel``.

* Blocks: 20 dual-stream ``transformer_blocks`` then 40
  ``single_transformer_blocks``; both take ``(hidden_states,
  encoder_hidden_states, temb, attention_mask, ...)`` positionally and return
  ``(hidden_states, encoder_hidden_states)``.
* Sequence: joint attention with the video tokens first and the text last;
  the text carries a padding mask (a ``[B, 1, 1, S]`` key mask).
* CFG: guidance-distilled (guidance embedding); ``true_cfg_scale > 1`` with a
  negative prompt adds separate calls in ``cache_context``.
* Quantization skips the patch and context embedders (the latter holds the
  text token refiner), the timestep/guidance embedders, the final
  norm/projection and the AdaLN modulation linears.
* TeaCache: the first block's ``norm1(hidden_states, emb=temb)``, with the
  TeaCache4HunyuanVideo polynomial (ali-vilab/TeaCache).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from omni_diffusion.adapters import register_adapter
from omni_diffusion.adapters.base import (
    BlockCall,
    BlockList,
    CFGInfo,
    ModelAdapter,
    SequenceLayout,
    modulated_norm_input,
)

#: TeaCache4HunyuanVideo, highest power first
HUNYUAN_VIDEO_TEACACHE_COEFFICIENTS = (
    7.33226126e02, -4.01131952e02, 6.75869174e01, -3.14987800e00, 9.61237896e-02,
)


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
    cfg = CFGInfo("distilled", guidance_embedded=True, true_cfg_argument="true_cfg_scale")
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

    def teacache_input(self, block: nn.Module, call: BlockCall) -> torch.Tensor | None:
        norm = getattr(block, "norm1", None) or getattr(block, "norm", None)
        return None if norm is None else modulated_norm_input(norm, call)

    def teacache_coefficients(self, transformer: nn.Module, pipe: Any = None):
        return HUNYUAN_VIDEO_TEACACHE_COEFFICIENTS
