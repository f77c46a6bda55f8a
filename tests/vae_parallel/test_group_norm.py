"""Distributed GroupNorm on height shards against nn.GroupNorm on the gathered tensor."""

from __future__ import annotations

import torch

from omni_diffusion.vae_parallel import distributed_group_norm
from omni_diffusion.vae_parallel.sharding import RowSplit

from ._ranks import run_ranks


def _group_norm_on_shards(rank, world, group, shape, groups):
    gen = torch.Generator().manual_seed(3)
    # A large common offset and outlier channels: what breaks a sum-of-squares variance, and
    # what an average of per-rank variances gets wrong when shards differ.
    x = torch.randn(shape, generator=gen) * 2.0 + 5.0
    x[:, 1] *= 20.0
    x[..., : shape[-2] // 3, :] += 3.0
    norm = torch.nn.GroupNorm(groups, shape[1], eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.5 * torch.randn(shape[1], generator=gen))
        norm.bias.copy_(torch.randn(shape[1], generator=gen))
        reference = norm(x)
        split = RowSplit(shape[-2], world)
        start, rows = split.offsets[rank], split.sizes[rank]
        local = x.narrow(-2, start, rows)
        out = distributed_group_norm(group, local, groups, norm.weight, norm.bias, norm.eps)
        ref_local = reference.narrow(-2, start, rows)
        naive = torch.nn.functional.group_norm(local, groups, norm.weight, norm.bias, norm.eps)
    return ((out - ref_local).abs().max().item(), (naive - ref_local).abs().max().item())


def test_group_norm_exact_on_2_ranks_4d():
    for diff, naive in run_ranks(2, _group_norm_on_shards, (2, 8, 7, 5), 4):
        assert diff <= 1e-4
        assert naive > 1e-2  # per-shard statistics would be wrong: the test can fail


def test_group_norm_exact_on_4_ranks_5d():
    for diff, naive in run_ranks(4, _group_norm_on_shards, (1, 6, 3, 9, 4), 3):
        assert diff <= 1e-4
        assert naive > 1e-2
