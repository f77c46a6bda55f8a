"""``vae_parallel="auto"``: which mode decodes a given latent on a given group.

Spatial sharding is exact (it equals a single-GPU, untiled decode) and cuts activation memory by
about the group size, but every rank needs enough latent rows that the convolution halos (one or
two rows each) stay small next to its shard, so it is chosen when each rank gets at least
:data:`MIN_SPATIAL_ROWS_PER_RANK` latent rows. Smaller latents go through diffusers' decode, which
tiles (tile-parallel) when tiling is on and the latent exceeds one tile, and otherwise decodes the
whole latent on every rank (it is too small to be worth splitting).
"""

from __future__ import annotations

VAE_PARALLEL_MODES = ("tile", "spatial", "auto")
# 8 latent rows = 64 output rows per rank for an 8x VAE: a 3x3 conv's two halo rows add at most
# 25% to a rank's rows at the latent resolution and under 4% at full resolution.
MIN_SPATIAL_ROWS_PER_RANK = 8


def choose_decode_mode(latent_height: int, world: int) -> str:
    """``"spatial"`` or ``"diffusers"`` (diffusers' own decode, tile-parallel if it tiles).

    Args:
        latent_height: rows of the latent ``z`` (its second-to-last dimension).
        world: ranks in the VAE group.
    """
    if latent_height < 1 or world < 1:
        raise ValueError(f"latent_height and world must be >= 1; got {latent_height}, {world}")
    if world > 1 and latent_height >= MIN_SPATIAL_ROWS_PER_RANK * world:
        return "spatial"
    return "diffusers"
