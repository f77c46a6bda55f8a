"""undo() of parallelism runs every step: VAE parallelism undone by unparallelize_vae, and a
failing step does not leave the steps after it installed."""

from __future__ import annotations

import pytest

from omni_diffusion.parallel.apply import _chain


def test_chain_runs_every_undo_then_raises_the_first_error():
    ran = []

    def failing(label):
        def fn():
            ran.append(label)
            raise RuntimeError(label)
        return fn

    undo = _chain([lambda: ran.append("first"), failing("second"), failing("third"),
                   lambda: ran.append("fourth")])
    with pytest.raises(RuntimeError, match="third"):
        undo()
    assert ran == ["fourth", "third", "second", "first"]


def test_undo_after_ulysses_and_spatial_vae_parallel(pools):
    for run in pools(2).run("vae_parallel_undo_case"):
        assert run["installed"]["vae_mode"] == "spatial" and run["installed"]["wrapped_blocks"] > 0, run
        assert run["error"] is None, run
        assert run["left"] == dict(vae_mode=None, wrapped_blocks=0), run
