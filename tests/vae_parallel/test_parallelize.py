"""parallelize_vae's contract: modes, refusals before any collective, undo, auto choice."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omni_diffusion.vae_parallel import (
    choose_decode_mode,
    parallelize_vae,
    unparallelize_vae,
    vae_parallel_mode,
)
from omni_diffusion.vae_parallel.mode import MIN_SPATIAL_ROWS_PER_RANK

from ._ranks import run_ranks
from ._vaes import tiny_latent, tiny_vae


def test_choose_decode_mode():
    assert choose_decode_mode(MIN_SPATIAL_ROWS_PER_RANK * 2, 2) == "spatial"
    assert choose_decode_mode(MIN_SPATIAL_ROWS_PER_RANK * 2 - 1, 2) == "diffusers"
    assert choose_decode_mode(200, 1) == "diffusers"
    with pytest.raises(ValueError, match="latent_height"):
        choose_decode_mode(0, 2)


def test_refuses_without_distributed():
    with pytest.raises(ValueError, match="torch.distributed"):
        parallelize_vae(tiny_vae("kl"), None, "spatial")


def _refusals(rank, world, group):
    errors = {}
    vae = tiny_vae("kl")
    for label, call in [
        ("mode", lambda: parallelize_vae(vae, group, "ring")),
        ("backend", lambda: parallelize_vae(vae, group, "spatial", halo_backend="nccl")),
        ("vae", lambda: parallelize_vae(torch.nn.Conv2d(1, 1, 1), group, "tile")),
        ("group", lambda: parallelize_vae(vae, "world", "tile")),
        ("output_rank", lambda: parallelize_vae(vae, group, "spatial", output_rank=world)),
    ]:
        try:
            call()
            errors[label] = None
        except ValueError as exc:
            errors[label] = str(exc)
    # A refused call leaves nothing patched.
    errors["untouched"] = "_decode" not in vae.__dict__ and vae_parallel_mode(vae) is None
    # Too small a latent for spatial mode raises on every rank alike, before any collective.
    parallelize_vae(vae, group, "spatial")
    try:
        vae.decode(torch.randn(1, 4, world - 1, 5))
        errors["small"] = None
    except ValueError as exc:
        errors["small"] = str(exc)
    try:
        parallelize_vae(vae, group, "tile")
        errors["twice"] = None
    except ValueError as exc:
        errors["twice"] = str(exc)
    unparallelize_vae(vae)
    dist.barrier(group)  # every rank is still in step: nothing hung in a collective
    return errors


def test_unsupported_combinations_raise_before_any_collective():
    for errors in run_ranks(2, _refusals):
        assert "mode must be one of" in errors["mode"]
        assert "halo_backend" in errors["backend"]
        assert "vae must be one of" in errors["vae"]
        assert "ProcessGroup" in errors["group"]
        assert "output_rank" in errors["output_rank"]
        assert errors["untouched"]
        assert "latent height of at least" in errors["small"]
        assert "already parallelized" in errors["twice"]


def _auto_and_output_rank(rank, world, group):
    vae = tiny_vae("kl")
    big = tiny_latent("kl", MIN_SPATIAL_ROWS_PER_RANK * world + 1, 5)
    small = tiny_latent("kl", 5, 5)
    with torch.no_grad():
        ref_big, ref_small = vae.decode(big).sample, vae.decode(small).sample
        parallelize_vae(vae, group, "auto", halo_backend="torch")
        assert vae_parallel_mode(vae) == "auto"
        out_big, out_small = vae.decode(big).sample, vae.decode(small).sample
        unparallelize_vae(vae)
        parallelize_vae(vae, group, "spatial", output_rank=1, halo_backend="torch")
        to_one = vae.decode(big).sample
    return ((out_big - ref_big).abs().max().item(), torch.equal(out_small, ref_small),
            tuple(to_one.shape), tuple(ref_big.shape),
            (to_one - ref_big).abs().max().item() if rank == 1 else 0.0)


def test_auto_mode_and_gather_to_one_rank():
    for rank, (big, small, to_one, full, diff) in enumerate(run_ranks(2, _auto_and_output_rank)):
        assert big <= 1e-4 and small
        if rank == 1:
            assert to_one == full and diff <= 1e-4
        else:
            assert to_one[-2] < full[-2]  # rank 0 keeps only its own rows
