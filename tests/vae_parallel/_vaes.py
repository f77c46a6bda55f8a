"""Tiny random diffusers VAEs of the four supported families, with their latents."""

from __future__ import annotations

import diffusers
import torch

from omni_diffusion.vae_parallel.families import layer_roles

# Import every diffusers model module now, in the parent: forked ranks then share it instead of
# each importing diffusers (seconds per process on a small machine).
layer_roles()


def _warm_fake_tensor_mode() -> None:
    # FakeTensorMode's first use initializes a lot (tile mode uses it); do it once, here.
    from torch._subclasses.fake_tensor import FakeTensorMode

    conv = torch.nn.Conv2d(2, 2, 3, padding=1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.nn.functional.group_norm(conv(torch.empty(1, 2, 4, 4)), 1)


_warm_fake_tensor_mode()


def tiny_vae(family: str):
    torch.manual_seed(0)
    if family == "kl":
        vae = diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=4,
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(4, 8), layers_per_block=1, sample_size=32,
        )
    elif family == "wan":
        vae = diffusers.AutoencoderKLWan(
            base_dim=4, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
            latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
        )
    elif family == "qwen":
        vae = diffusers.AutoencoderKLQwenImage(
            base_dim=4, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
            latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
        )
    elif family == "hunyuan":
        vae = diffusers.AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * 3,
            up_block_types=("HunyuanVideoUpBlock3D",) * 3, block_out_channels=(8, 8, 8),
            layers_per_block=1, norm_num_groups=4, spatial_compression_ratio=4,
            temporal_compression_ratio=4, mid_block_add_attention=True,
        )
    else:
        raise ValueError(f"family must be kl, wan, qwen or hunyuan; got {family!r}")
    return vae.eval()


def tiny_latent(family: str, height: int, width: int, frames: int = 2) -> torch.Tensor:
    """A random latent; 5-D ``[1, 4, frames, H, W]`` for the video VAEs (Qwen-Image: 1 frame)."""
    gen = torch.Generator().manual_seed(height * 100 + width)
    if family == "kl":
        return torch.randn(1, 4, height, width, generator=gen)
    frames = 1 if family == "qwen" else frames
    return torch.randn(1, 4, frames, height, width, generator=gen)


def enable_small_tiles(vae, family: str) -> None:
    """Tiles of 16 output pixels with a 4-pixel overlap, so tiny latents are tiled."""
    if family == "kl":
        vae.enable_tiling()
        vae.tile_sample_min_size = 16
        vae.tile_latent_min_size = 16 // 2 ** (len(vae.config.block_out_channels) - 1)
        vae.tile_overlap_factor = 0.25
    else:
        vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16,
                          tile_sample_stride_height=12, tile_sample_stride_width=12)
