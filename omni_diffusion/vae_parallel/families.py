"""The diffusers VAE classes VAE parallelism supports, and their layer types by role.

These are the model-specific facts (which classes are causal convolutions, which hold attention);
the wrappers in :mod:`.spatial` act on roles, never on model names. diffusers is imported lazily:
only VAE parallelism needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from torch import nn


@dataclass(frozen=True)
class LayerRoles:
    """Layer types of the supported decoders, grouped by how a height-sharded run treats them.

    * ``vaes``: the VAE classes supported at all (tile and spatial).
    * ``cached_causal_convs``: ``nn.Conv3d`` subclasses whose ``forward(x, cache_x=None)`` pads
      with ``self._padding`` (F.pad order: W, H, causal T) after prepending cached frames (Wan,
      Qwen-Image).
    * ``padding_causal_convs``: modules holding an unpadded ``.conv`` that first apply
      ``F.pad(x, self.time_causal_padding, mode=self.pad_mode)`` (HunyuanVideo).
    * ``global_context``: modules that mix all positions (attention); they run on the gathered
      feature map, which is their first argument, ``[B, C, H, W]`` or ``[B, C, T, H, W]``. The
      HunyuanVideo mid-block is listed whole because it flattens the map before its attention.
    * ``local``: leaf types that act per position or per row and need nothing from a neighbour.
    """

    vaes: tuple[type, ...]
    cached_causal_convs: tuple[type, ...]
    padding_causal_convs: tuple[type, ...]
    global_context: tuple[type, ...]
    local: tuple[type, ...]


@lru_cache(maxsize=1)
def layer_roles() -> LayerRoles:
    """The roles, resolved from the installed diffusers (raises ImportError naming it)."""
    try:
        from diffusers import (
            AutoencoderKL,
            AutoencoderKLHunyuanVideo,
            AutoencoderKLQwenImage,
            AutoencoderKLWan,
        )
        from diffusers.models.attention_processor import Attention
        from diffusers.models.autoencoders import autoencoder_kl_hunyuan_video as hunyuan
        from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwen
        from diffusers.models.autoencoders import autoencoder_kl_wan as wan
    except ImportError as exc:
        raise ImportError(f"VAE parallelism needs diffusers (pip install diffusers): {exc}") from exc
    return LayerRoles(
        vaes=(AutoencoderKL, AutoencoderKLQwenImage, AutoencoderKLWan, AutoencoderKLHunyuanVideo),
        cached_causal_convs=(wan.WanCausalConv3d, qwen.QwenImageCausalConv3d),
        padding_causal_convs=(hunyuan.HunyuanVideoCausalConv3d,),
        global_context=(Attention, wan.WanAttentionBlock, qwen.QwenImageAttentionBlock,
                        hunyuan.HunyuanVideoMidBlock3D),
        local=(wan.WanRMS_norm, qwen.QwenImageRMS_norm, nn.Dropout, nn.Identity, nn.Linear),
    )


def check_supported_vae(vae: nn.Module) -> None:
    """Raise ``ValueError`` unless ``vae`` is one of the supported diffusers VAE classes."""
    roles = layer_roles()
    if not isinstance(vae, roles.vaes):
        names = ", ".join(cls.__name__ for cls in roles.vaes)
        raise ValueError(f"vae must be one of {names}; got {type(vae).__name__}")
