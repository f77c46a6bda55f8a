"""omni's step caches (First-Block-Cache, TeaCache): block plumbing per family, step rules,
per-generation state and its isolation between concurrent generations."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("diffusers")

import omni_diffusion as od  # noqa: E402
from omni_diffusion import cache  # noqa: E402
from omni_diffusion.testing import output_tensor, tiny_call_kwargs, tiny_pipeline  # noqa: E402

_PIPES: dict[str, object] = {}


def _pipe(name):
    if name not in _PIPES:
        _PIPES[name] = tiny_pipeline(name)
    return _PIPES[name]


def _captured_call(pipe, family):
    """The (args, kwargs) of the first transformer call of a pipeline run."""
    captured = []

    def hook(module, args, kwargs):
        if not captured:
            clone = lambda v: v.clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
            captured.append((tuple(clone(a) for a in args), {k: clone(v) for k, v in kwargs.items()}))

    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        pipe(**tiny_call_kwargs(family, steps=1, cfg=False, pipe=pipe))
    finally:
        handle.remove()
    return captured[0]


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out.sample


@pytest.fixture
def undo_after():
    touched = []
    yield touched.append
    for pipe in touched:
        od.undo(pipe)


@pytest.mark.parametrize("family", ["flux", "sd3", "wan", "qwen_image", "hunyuan_video"])
@pytest.mark.parametrize("kind", ["first_block", "teacache"])
def test_hit_on_identical_inputs_reproduces_the_full_output(family, kind, undo_after):
    """Two passes with the same inputs: the second is served from the cache, and
    ``cached residual + first block`` must give the full stack's output again. This
    checks each adapter's block inputs/outputs (order, which stream) end to end."""
    pipe = _pipe(family)
    args, kwargs = _captured_call(pipe, family)
    transformer = pipe.transformer
    with torch.no_grad():
        expected = _first(transformer(*args, **kwargs))
    od.accelerate(pipe, od.AccelConfig(attention=None, cache=od.CacheConfig(
        kind, threshold=1e6, warmup_steps=1, final_steps=0)))
    undo_after(pipe)
    with torch.no_grad():
        # outside a generation the hooks do nothing
        assert torch.equal(_first(transformer(*args, **kwargs)), expected)
        with cache.generation() as gen:
            with cache.branch("cond"):
                first = _first(transformer(*args, **kwargs))
            with cache.branch("cond"):
                second = _first(transformer(*args, **kwargs))
    stats = gen.stats()
    assert stats.passes == 2 and stats.hits == 1, stats
    assert torch.equal(first, expected)
    err = ((second - expected).norm() / expected.norm()).item()
    assert err < 1e-5, err
    if kind == "first_block":
        assert stats.branches["transformer/cond"]["distances"] == [0.0]


def _flux_stats(steps, **cache_fields):
    pipe = _pipe("flux")
    od.accelerate(pipe, od.AccelConfig(attention=None, cache=od.CacheConfig(**cache_fields)))
    try:
        pipe(**tiny_call_kwargs("flux", steps=steps, cfg=False))
        return od.last_cache_stats(pipe)
    finally:
        od.undo(pipe)


def test_step_rules():
    big = 1e6
    # warm-up and final steps always compute
    stats = _flux_stats(6, kind="first_block", threshold=big, warmup_steps=2, final_steps=1)
    assert (stats.passes, stats.hits) == (6, 3)
    # at most one hit in a row: steps 1..5 go hit, miss, hit, miss, hit
    stats = _flux_stats(6, kind="first_block", threshold=big, max_consecutive_hits=1)
    assert (stats.passes, stats.hits) == (6, 3)
    # TeaCache's defaults on Flux: warm-up 1, last step computed
    stats = _flux_stats(6, kind="teacache", threshold=big)
    assert (stats.passes, stats.hits) == (6, 4)
    assert stats.skipped_fraction == pytest.approx(4 / 6)  # TeaCache skips whole passes
    assert stats.to_dict()["hit_rate"] == pytest.approx(4 / 6)
    # TeaCache accumulates the rescaled distance and computes (and restarts) once the sum
    # reaches the threshold: a constant polynomial 2 with threshold 5 -> hit, hit, compute, ...
    stats = _flux_stats(6, kind="teacache", threshold=5.0, coefficients=(0.0, 2.0), final_steps=0)
    (branch,) = stats.branches.values()
    assert branch["distances"] == [2.0] * 5 and stats.hits == 4


def test_no_skippable_step_is_warned_once(caplog):
    """TeaCache on Flux (warm-up 1, final 1) over 2 steps cannot skip: one warning says so,
    not one per call; 3 steps can skip, and say nothing."""
    with caplog.at_level("WARNING", logger="omni_diffusion.cache"):
        pipe = _pipe("flux")
        od.accelerate(pipe, od.AccelConfig(attention=None, cache=od.CacheConfig(kind="teacache", threshold=1e6)))
        try:
            for _ in range(2):
                pipe(**tiny_call_kwargs("flux", steps=2, cfg=False))
            assert od.last_cache_stats(pipe).hits == 0
        finally:
            od.undo(pipe)
    warnings = [r.getMessage() for r in caplog.records if "no step can be skipped" in r.getMessage()]
    assert len(warnings) == 1 and "teacache" in warnings[0] and "2 steps" in warnings[0] \
        and "1 warm-up + 1 final" in warnings[0], warnings
    caplog.clear()
    with caplog.at_level("WARNING", logger="omni_diffusion.cache"):
        stats = _flux_stats(3, kind="teacache", threshold=1e6)
    assert stats.hits == 1 and not [r for r in caplog.records if "no step can be skipped" in r.getMessage()]


def test_stats_per_call_and_collect(undo_after):
    pipe = _pipe("flux")
    od.accelerate(pipe, od.AccelConfig(attention=None, cache=od.CacheConfig("first_block", threshold=1e6)))
    undo_after(pipe)
    with od.collect_stats() as collected:
        pipe(**tiny_call_kwargs("flux", steps=3, cfg=False))
        pipe(**tiny_call_kwargs("flux", steps=5, cfg=False))
    assert [s.passes for s in collected] == [3, 5] and [s.hits for s in collected] == [2, 4]
    assert od.last_cache_stats(pipe) == collected[-1] and pipe.omni_stats is collected[-1]


def test_concurrent_generations_are_isolated(undo_after):
    """Two threads denoise with the same accelerated transformer at the same time,
    steps interleaved by a barrier: each gets exactly what it gets alone."""
    pipe = _pipe("flux")
    args, kwargs = _captured_call(pipe, "flux")
    transformer = pipe.transformer
    od.accelerate(pipe, od.AccelConfig(attention=None, cache=od.CacheConfig("first_block", threshold=0.3)))
    undo_after(pipe)
    steps = 6

    def denoise(seed, barrier=None):
        gen = torch.Generator().manual_seed(seed)
        latents = kwargs["hidden_states"] + 0.5 * torch.randn(kwargs["hidden_states"].shape, generator=gen)
        outs = []
        with torch.no_grad(), cache.generation() as state:
            for step in range(steps):
                if barrier is not None:
                    barrier.wait()
                t = torch.full_like(kwargs["timestep"], 1.0 - step / steps)
                with transformer.cache_context("cond"):
                    noise = _first(transformer(*args, **{**kwargs, "hidden_states": latents, "timestep": t}))
                latents = latents - noise / steps
                outs.append(latents)
        return torch.stack(outs), state.stats()

    alone = [denoise(seed) for seed in (1, 2)]
    assert all(stats.hits > 0 for _, stats in alone)  # the cache is actually used
    assert alone[0][1] != alone[1][1] or not torch.equal(alone[0][0], alone[1][0])
    barrier = threading.Barrier(2)
    results: dict[int, tuple] = {}
    errors = []

    def worker(seed):
        try:
            results[seed] = denoise(seed, barrier)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    for index, seed in enumerate((1, 2)):
        latents, stats = results[seed]
        assert stats == alone[index][1]
        assert torch.allclose(latents, alone[index][0], rtol=0, atol=1e-6)


def test_pipeline_calls_do_not_share_state(undo_after):
    """A call does not see the previous call's residuals: calling with another prompt
    in between leaves the result of a call unchanged."""
    pipe = _pipe("flux")
    od.accelerate(pipe, od.AccelConfig(attention=None, cache=od.CacheConfig("first_block", threshold=0.2)))
    undo_after(pipe)
    first = output_tensor(pipe(**tiny_call_kwargs("flux", steps=4)))
    stats = od.last_cache_stats(pipe)
    pipe(**tiny_call_kwargs("flux", steps=4, prompt="something else", seed=7))
    again = output_tensor(pipe(**tiny_call_kwargs("flux", steps=4)))
    assert torch.equal(first, again) and od.last_cache_stats(pipe) == stats
