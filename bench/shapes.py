"""The model shapes the benchmarks time, in one place: each diffusion transformer's attention
(sequence, heads, head dim) and linear widths at the resolution the records use.

``tokens`` is the sequence attention sees: image or video latent tokens, plus the text tokens
where the model attends jointly (Flux, SD3.5, Qwen-Image). Shapes are batch 1.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    name: str  # as the records and tables name the shape
    note: str
    tokens: int
    heads: int
    head_dim: int
    ffn: int = 0  # MLP / FFN hidden width (0: no linear benchmark uses it)

    @property
    def width(self) -> int:
        """The model width, heads x head_dim: the attention projections' K and N."""
        return self.heads * self.head_dim

    def bhsd(self) -> tuple[int, int, int, int]:
        """(batch, heads, tokens, head_dim) of its self-attention."""
        return 1, self.heads, self.tokens, self.head_dim

    def self_attention(self) -> tuple[int, int, int, int, int]:
        """(batch, heads, queries, keys, head_dim) of its self-attention."""
        return 1, self.heads, self.tokens, self.tokens, self.head_dim


TEXT_TOKENS = 512  # the T5 / Qwen prompt length in the shapes below
FLUX = Model("flux-1024", "Flux.1 1024x1024: 4096 image + 512 text tokens, 24 heads x 128", 4608, 24, 128, 12288)
SD35 = Model("sd3.5-1024", "SD3.5 Large 1024x1024: 4096 image + 333 text tokens, 38 heads x 64", 4429, 38, 64)
QWEN_IMAGE = Model("qwen-image-1328", "Qwen-Image 1328x1328: 6889 image + 512 text tokens, 24 heads x 128",
                   7401, 24, 128)
WAN_480P = Model("wan2.1-14b-480p", "Wan2.1-14B 480p 81 frames: 32760 tokens, 40 heads x 128", 32760, 40, 128, 13824)
WAN_720P = Model("wan2.1-14b-720p", "Wan2.1-14B 720p 81 frames: 75600 tokens, 40 heads x 128", 75600, 40, 128, 13824)
HUNYUAN_720P = Model("hunyuanvideo-720p", "HunyuanVideo 720p 129 frames: 119040 tokens, 24 heads x 128",
                     119040, 24, 128)

#: Flux.1's adaLN modulation linears: output widths (6 and 3 x the width: shift, scale, gate ...)
FLUX_ADALN = {"double": 6 * FLUX.width, "single": 3 * FLUX.width}
#: Flux.1's single blocks' proj_out input: the attention output beside the MLP's
FLUX_SINGLE_PROJ_OUT_IN = FLUX.width + FLUX.ffn
