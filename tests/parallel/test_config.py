"""ParallelConfig validation, and bad configs failing on every rank before any collective."""

from __future__ import annotations

import re

import pytest

import omni_diffusion as od
from omni_diffusion.parallel.config import ParallelConfig, split_sizes


@pytest.mark.parametrize("field,value", [("cfg", 3), ("ulysses", 0), ("ring", -1), ("tp", 1.5),
                                         ("vae", True), ("vae_mode", "tiles")])
def test_bad_field_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=f"ParallelConfig.{field}: {value!r}"):
        ParallelConfig(**{field: value})


def test_world_size_must_be_the_product():
    config = ParallelConfig(cfg=2, ulysses=2, ring=2)
    assert config.world_size == 8 and config.sequence_degree == 4
    config.check_world(8)
    with pytest.raises(ValueError, match="needs cfg\\*ring\\*ulysses\\*tp = 8 ranks, but the world size is 4"):
        config.check_world(4)
    with pytest.raises(ValueError, match="ParallelConfig.vae: 3"):
        ParallelConfig(cfg=2, vae=3).check_world(2)


def test_split_sizes_are_tensor_split():
    assert split_sizes(63, 4) == [16, 16, 16, 15]
    assert split_sizes(2, 4) == [1, 1, 0, 0]


def test_accel_config_parallel_round_trip_and_cache_conflict():
    config = od.AccelConfig(parallel={"cfg": 2, "tp": 2})
    assert config.parallel == ParallelConfig(cfg=2, tp=2)
    assert od.AccelConfig.from_dict(config.to_dict()) == config
    assert od.AccelConfig(parallel=ParallelConfig()).parallel is None  # nothing split
    with pytest.raises(ValueError, match="AccelConfig.cache"):
        od.AccelConfig(parallel={"ulysses": 2}, cache="first_block")
    with pytest.raises(ValueError, match="AccelConfig.parallel"):
        od.AccelConfig(parallel=2)


#: a family whose adapter declares no sequence/tensor-parallel plan (every tiny family has
#: them now: the Qwen-Image adapter stripped of its plans stands in)
WITHOUT_PLANS = "-without-plans"

BAD = [
    # world, family, config, message
    (2, "flux", dict(ulysses=4), "needs cfg\\*ring\\*ulysses\\*tp = 4 ranks, but the world size is 2"),
    (2, "flux", dict(tp=2, ulysses=2), "world size is 2"),
    (4, "flux", dict(tp=4), "tp=4 does not divide the 2 heads"),
    (2, "qwen_image" + WITHOUT_PLANS, dict(ulysses=2), "not available for the qwen_image family"),
    (2, "flux", dict(cfg=2, vae=2), "omni_diffusion.vae_parallel"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: f"w{c[0]}-{c[1]}-" + "-".join(f"{k}{v}" for k, v in c[2].items()))
def test_bad_config_fails_before_any_collective(pools, case):
    world, family, config, message = case
    strip = family.endswith(WITHOUT_PLANS)
    family = family.removesuffix(WITHOUT_PLANS)
    messages = pools(world).run("bad_config_case", family, config, "vae_parallel" in message, strip)
    assert all(m is not None and re.search(message, m) for m in messages), messages


def test_vae_alone_splits_any_multiple_of_its_degree():
    config = ParallelConfig(vae=2)
    assert config.vae_only and config.enabled
    config.check_world(2)
    config.check_world(4)
    with pytest.raises(ValueError, match="ParallelConfig.vae: 2 is not allowed; allowed: a divisor of the world size 3"):
        config.check_world(3)
    with pytest.raises(ValueError, match="world size is 4"):  # with a denoising degree the product rules
        ParallelConfig(cfg=2, vae=2).check_world(4)


@pytest.mark.parametrize("world", [2, 4])
def test_vae_only_parallelism_matches_single_process(pools, world):
    """ParallelConfig(vae=2) alone through accelerate(): over 2 ranks (one VAE group) and 4
    (two groups), the transformer whole on every rank; the decoded images equal the
    single-process decode."""
    for diff, scale, mode in pools(world).run("vae_only_case", 2, "spatial"):
        assert mode == "spatial" and scale > 0.1 and diff <= 1e-4, (diff, scale, mode)
