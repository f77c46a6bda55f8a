"""Tile-parallel decode and encode against diffusers' own tiled path (gloo, CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from omni_diffusion.vae_parallel import parallelize_vae

from ._ranks import run_ranks
from ._vaes import enable_small_tiles, tiny_latent, tiny_vae


def _tiled_decode_vs_diffusers(rank, world, group, family, height, width):
    vae = tiny_vae(family)
    enable_small_tiles(vae, family)
    z = tiny_latent(family, height, width)
    with torch.no_grad():
        reference = vae.decode(z).sample
        calls = []
        original_tiled = vae.tiled_decode
        parallelize_vae(vae, group, "tile")
        parallel_tiled = vae.tiled_decode
        assert parallel_tiled is not original_tiled
        vae.tiled_decode = lambda *a, **k: calls.append(1) or parallel_tiled(*a, **k)
        out = vae.decode(z).sample
    return dict(equal=torch.equal(out, reference), diff=(out - reference).abs().max().item(),
                tiled_calls=len(calls))


def _tiled_encode_vs_diffusers(rank, world, group, family, height, width):
    vae = tiny_vae(family)
    enable_small_tiles(vae, family)
    factor = 2
    shape = (1, 3, height * factor, width * factor) if family == "kl" else (
        1, 3, 1, height * factor, width * factor)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        reference = vae.encode(x).latent_dist.mean
        parallelize_vae(vae, group, "tile")
        out = vae.encode(x).latent_dist.mean
    return dict(equal=torch.equal(out, reference), diff=(out - reference).abs().max().item(),
                tiled_calls=1)


CASES = [("kl", 2, 13, 11), ("kl", 4, 17, 9), ("wan", 2, 13, 9), ("wan", 4, 9, 11),
         ("qwen", 2, 13, 9), ("hunyuan", 4, 11, 13)]


@pytest.mark.parametrize("family,world,height,width", CASES)
def test_tile_decode_equals_diffusers_tiled_decode(family, world, height, width):
    for rank, r in enumerate(run_ranks(world, _tiled_decode_vs_diffusers, family, height, width)):
        assert r["tiled_calls"] >= 1, "the latent was not tiled: the test would prove nothing"
        assert r["equal"], (rank, r)


@pytest.mark.parametrize("family,world", [("kl", 2), ("wan", 4)])
def test_tile_encode_equals_diffusers_tiled_encode(family, world):
    for rank, r in enumerate(run_ranks(world, _tiled_encode_vs_diffusers, family, 13, 11)):
        assert r["equal"], (rank, r)
