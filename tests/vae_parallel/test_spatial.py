"""Spatially-sharded decode of each VAE family against a single-rank decode (gloo, CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from omni_diffusion.vae_parallel import parallelize_vae, unparallelize_vae

from ._ranks import run_ranks
from ._vaes import tiny_latent, tiny_vae


def _spatial_vs_single(rank, world, group, family, height, width, backend):
    vae = tiny_vae(family)
    z = tiny_latent(family, height, width)
    with torch.no_grad():
        reference = vae.decode(z).sample
        state_before = {k: v.clone() for k, v in vae.state_dict().items()}
        parallelize_vae(vae, group, "spatial", halo_backend=backend)
        assert list(vae.state_dict()) == list(state_before)
        out = vae.decode(z).sample
        again = vae.decode(z).sample  # the persistent buffers are reused
        unparallelize_vae(vae)
        restored = vae.decode(z).sample
    return dict(
        diff=(out - reference).abs().max().item(),
        again=(again - reference).abs().max().item(),
        restored=torch.equal(restored, reference),
        shape=tuple(out.shape) == tuple(reference.shape),
    )


# Odd latent heights: never a multiple of the rank count, so shards are uneven.
CASES = [
    ("kl", 2, 5, 3, "triton"),
    ("kl", 4, 9, 5, "torch"),
    ("wan", 2, 7, 6, "torch"),
    ("wan", 4, 9, 5, "torch"),
    ("qwen", 2, 5, 7, "torch"),
    ("qwen", 4, 11, 6, "torch"),
    ("hunyuan", 2, 5, 6, "torch"),
    ("hunyuan", 4, 9, 4, "torch"),
]


@pytest.mark.parametrize("family,world,height,width,backend", CASES)
def test_spatial_decode_matches_single_rank(family, world, height, width, backend):
    results = run_ranks(world, _spatial_vs_single, family, height, width, backend)
    for rank, r in enumerate(results):
        assert r["shape"], rank
        assert r["diff"] <= 1e-4, (rank, r)
        assert r["again"] <= 1e-4, (rank, r)
        assert r["restored"], rank
