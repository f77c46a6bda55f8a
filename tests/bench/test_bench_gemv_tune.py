"""bench/gemv_tune.py on the CPU: the settings grid (non-empty, pruned, capped, valid launcher
calls), the refinement, the output check, the table, the refusal without a GPU, and the whole
sweep at a tiny shape in Triton's interpreter (fake times; the timings themselves need a GPU)."""

from __future__ import annotations

import inspect
import json

from dataclasses import replace

import pytest
import torch

from omni_kernels._triton import triton_interpreter_enabled

CASE_ROWS = (1, 2)


@pytest.fixture(scope="module")
def tune():
    from bench import gemv_tune

    return gemv_tune


def _all_grids(tune):
    """(rows, shape, coarse grid, refinement of the coarse grid taken as ranked) of every case."""
    for shape in tune.SHAPES.values():
        for rows in CASE_ROWS:
            coarse = tune.coarse_grid(rows, shape)
            yield rows, shape, coarse, tune.refine_grid(coarse, set(coarse), rows, shape)


def test_coarse_grid_is_nonempty_pruned_and_capped(tune):
    for rows, shape, coarse, _ in _all_grids(tune):
        assert 0 < len(coarse) <= tune.COARSE_CAP
        assert len(set(coarse)) == len(coarse)
        assert [s for s in coarse if tune.prune_reason(s, rows, shape) is not None] == []
        assert any(s.use_dot for s in coarse) and any(not s.use_dot for s in coarse)
        # x_tile_load both ways at some tiles (the plan's last CUDA-core entry, not cut by the cap).
        tiled = [s for s in coarse if s.x_tile_load]
        assert tiled and all(replace(s, x_tile_load=False) in coarse for s in tiled)
        assert not any(s.use_dot and s.x_tile_load for s in coarse)
    double = tune.SHAPES["flux-adaln-double"]
    assert len(tune.coarse_grid(1, double, cap=5)) == 5
    # Two rows hold fewer accumulators a thread: the plan's largest tiles are pruned.
    assert len(tune.coarse_grid(2, double)) < len(tune.coarse_grid(1, double))


def test_prune_reasons(tune):
    setting, double, single = tune.Setting, tune.SHAPES["flux-adaln-double"], tune.SHAPES["flux-adaln-single"]
    # The launcher's default tiles at one and two rows are swept.
    assert tune.prune_reason(setting(False, 32, 256, 4, 1), 1, double) is None
    assert tune.prune_reason(setting(False, 16, 256, 4, 1), 2, double) is None
    assert "CUDA-core" in tune.prune_reason(setting(False, 16, 256, 4, 1), 8, double)
    assert "registers" in tune.prune_reason(setting(False, 128, 256, 4, 1), 2, double)
    assert "vectors" in tune.prune_reason(setting(False, 16, 64, 8, 1), 1, double)
    assert "shared memory" in tune.prune_reason(setting(True, 64, 512, 8, 4), 1, double)
    assert "wider than K" in tune.prune_reason(setting(False, 16, 512, 4, 1), 1, tune.SHAPES["tiny"])
    assert "already fill" in tune.prune_reason(setting(False, 32, 256, 4, 1, 2), 1, double)
    assert tune.prune_reason(setting(False, 128, 128, 8, 1, 2), 1, single) is None  # 72 column blocks
    assert "chunks" in tune.prune_reason(setting(False, 16, 128, 4, 1, 4), 1, tune.SHAPES["tiny"])
    assert "CUDA-core" in tune.prune_reason(setting(True, 64, 128, 4, 3, 1, True), 1, double)
    # Pipelined with x_tile_load, each stage holds an x tile a row besides the weight tile:
    # 2 x (8 KiB + 3 x 16 KiB) fit in 160 KiB, 4 x 56 KiB do not; 4 weight tiles alone do.
    assert tune.prune_reason(setting(False, 32, 256, 8, 2, 1, True), 3, double) is None
    assert "shared memory" in tune.prune_reason(setting(False, 32, 256, 8, 4, 1, True), 3, double)
    assert tune.prune_reason(setting(False, 32, 256, 8, 4, 1, False), 3, double) is None


def test_fill_split(tune):
    double, single, tiny = (tune.SHAPES[name] for name in ("flux-adaln-double", "flux-adaln-single", "tiny"))
    assert tune.fill_split(32, 256, double) == 1  # 576 column blocks
    assert tune.fill_split(128, 256, single) == 2  # 72
    assert tune.fill_split(256, 128, single) == 4  # 36
    assert tune.fill_split(16, 256, tiny) == 1  # K is one block_k chunk
    assert tune.fill_split(16, 64, tiny) == 4  # 6 column blocks, 4 chunks


def test_refinement_takes_unmeasured_neighbours_of_the_fastest(tune):
    for rows, shape, coarse, refine in _all_grids(tune):
        assert 0 < len(refine) <= tune.REFINE_CAP
        assert len(set(refine)) == len(refine) and not set(refine) & set(coarse)
        assert [s for s in refine if tune.prune_reason(s, rows, shape) is not None] == []
        parents = coarse[: tune.REFINE_TOP]
        assert all(any(s in tune.neighbours(p, shape) for p in parents) for s in refine)
    shape = tune.SHAPES["flux-adaln-single"]
    ranked = tune.coarse_grid(1, shape)
    assert len(tune.refine_grid(ranked, set(ranked), 1, shape, cap=3)) == 3
    # Each neighbour moves one knob (a new tile may bring its own split_k).
    parent = tune.Setting(False, 32, 256, 4, 3)
    near_parent = tune.neighbours(parent, shape)
    for near in near_parent:
        moved = {k for k, v in near.options().items() if v != parent.options()[k]} - {"split_k"}
        assert len(moved) == 1 or (not moved and near.split_k != parent.split_k)
    # The first neighbour flips x_tile_load (CUDA-core path only).
    assert near_parent[0] == replace(parent, x_tile_load=True)
    assert tune.neighbours(near_parent[0], shape)[0] == parent
    assert not any(s.x_tile_load for s in tune.neighbours(tune.Setting(True, 64, 128, 4, 3), shape))


def test_every_setting_is_a_valid_launcher_call(tune):
    from omni_kernels.quant.triton_gemv import launch_weight_only_gemv

    allowed = set(inspect.signature(launch_weight_only_gemv).parameters)
    checked = 0
    for rows, shape, coarse, refine in _all_grids(tune):
        # M=0 on the meta device: the launcher checks every knob, then returns before launching.
        x = torch.empty(0, shape.k, dtype=torch.bfloat16, device="meta")
        for weight in tune.WEIGHT_DTYPES.values():
            w_q = torch.empty(shape.n, shape.k, dtype=weight, device="meta")
            w_scale = torch.empty(shape.n, dtype=torch.float32, device="meta")
            for setting in coarse + refine:
                assert set(setting.options()) <= allowed
                assert launch_weight_only_gemv(x, w_q, w_scale, None, **setting.options()).shape == (0, shape.n)
                checked += 1
    assert checked > 100


def test_compare_with_default(tune):
    gen = torch.Generator().manual_seed(0)
    default = torch.randn(4, 512, generator=gen).to(torch.bfloat16)
    assert tune.compare_with_default(default.clone(), default)["status"] == "ok"
    # Every value one bf16 step away (another summation order rounding apart): ~2e-3 rel L2.
    stepped = torch.nextafter(default.float(), torch.full_like(default.float(), float("inf"))).to(torch.bfloat16)
    stepped = torch.where(stepped == default, torch.nextafter(default, torch.full_like(default, float("inf"))), stepped)
    check = tune.compare_with_default(stepped, default)
    assert check["max_steps_vs_default"] == 1 and check["rel_l2_vs_default"] > tune.SAME_REL_L2
    assert check["status"] == "ok (one rounding step)"
    # A few values near zero several steps apart (a sum with cancellation, in another order).
    near_zero = default.clone()
    near_zero[0, :3] = torch.tensor([0.05, -0.06, 0.04]).to(torch.bfloat16)
    moved = near_zero.clone()
    for _ in range(5):
        moved[0, :3] = torch.nextafter(moved[0, :3], torch.full_like(moved[0, :3], float("inf")))
    check = tune.compare_with_default(moved, near_zero)
    assert check["max_steps_vs_default"] == 5 and check["status"].startswith("ok (summation order")
    wrong = default.clone()
    wrong[:, :8] *= 2  # one K chunk counted twice, say
    assert tune.compare_with_default(wrong, default)["status"].startswith("differs")
    single = torch.randn(4, 512, generator=gen)
    assert tune.compare_with_default(single * (1 + 1e-7), single)["status"] == "ok"
    assert tune.compare_with_default(single * (1 + 1e-4), single)["status"].startswith("differs")


def test_markdown_table(tune):
    env = dict(device="NVIDIA H200", torch="2.11", cuda="13.0", packages={"triton": "3.6"}, git_commit="abc",
               utc="now", command="python3 bench/gemv_tune.py")
    best = tune.Setting(False, 32, 256, 8, 3)
    base = dict(shape="flux-adaln-double", weight="int8", m=1)
    rows = [
        dict(base, setting="bf16 F.linear", phase="baseline", options={}, us=42.0, gbps=2696.0, vs_bf16=1.0,
             host_us=8.0, status="ok", padded_us=41.0),
        dict(base, setting="default", phase="default", options={}, us=116.0, gbps=488.0, vs_bf16=42 / 116,
             host_us=30.0, status="ok", rel_l2_vs_default=0.0, regs=126, spills=0, smem=1024),
        dict(base, setting=best.label, phase="coarse", options=best.options(), us=21.0, gbps=2696.0, vs_bf16=2.0,
             host_us=30.0, status="ok (one rounding step)", rel_l2_vs_default=1e-4, regs=120, spills=0,
             smem=17408, padded_us=20.5),
        dict(base, setting="fma-16x64-w2-s1", phase="refine", options=tune.Setting(False, 16, 64, 2, 1).options(),
             us=10.0, gbps=5000.0, vs_bf16=4.2, host_us=30.0, status="differs from the default: rel L2 1.0e-01"),
        dict(base, setting="dot-64x512-w8-s4", phase="refine", options=tune.Setting(True, 64, 512, 8, 4).options(),
             status="error: OutOfResources: shared memory"),
    ]
    table = tune.markdown(env, rows, flush_us=70.0)
    # The best is the fastest that agrees with the default (not the faster one that differs).
    assert ("| flux-adaln-double | int8 | 1 | 42.0 | 116.0 | - | fma-32x256-w8-s3 | 21.0 | 20.5 | 2696 | 2.00x "
            "| 5.52x | 120/0 | 3 |") in table
    assert "| fma-16x64-w2-s1 | refine | 10.0 | - | 5000 |" in table
    assert "| dot-64x512-w8-s4 | refine | - | - | - | - | - | - | - | - | - | error: OutOfResources" in table
    assert "L2 flush: 70 us" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu(tune, capsys):
    assert tune.main(["--shapes", "tiny"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


@pytest.mark.skipif(not triton_interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
def test_sweep_runs_in_the_interpreter(tune, monkeypatch, tmp_path):
    """The whole sweep at the tiny shape, float16 on the CPU: every setting runs and agrees with
    the default; times are fake (a fixed sequence) but each timed call still runs."""
    fake_times = iter(float(t) for t in range(1000, 0, -1))

    def fake_median(fn, *, warmup, rep):
        fn()
        return next(fake_times)

    monkeypatch.setattr(tune.harness, "gpu_refusal", lambda script: None)
    monkeypatch.setattr(tune, "DEVICE", "cpu")
    monkeypatch.setattr(tune, "X_DTYPE", torch.float16)
    monkeypatch.setattr(tune.harness, "median_us", fake_median)
    monkeypatch.setattr(tune.harness, "host_us", lambda fn: 5.0)
    monkeypatch.setattr(tune.harness, "padded_us", lambda fn, host_us: 1.5)
    monkeypatch.setattr(tune, "_flush_us", lambda: 70.0)
    monkeypatch.setattr(tune, "_sm_count", lambda: tune.H200_SM_COUNT)
    # A small plan with both x loads (unpipelined and pipelined) and the tl.dot path.
    monkeypatch.setattr(tune, "COARSE_PLAN", ((False, ((16, 128),), (4,), (1,), False),
                                              (False, ((16, 128),), (4,), (1, 3), True),
                                              (True, ((64, 128),), (4,), (3,), False)))
    argv = ["--shapes", "tiny", "--weights", "int8", "--rows", "2", "--coarse-cap", "4", "--refine-top", "2",
            "--refine-cap", "3", "--jobs", "0", "--tag", "test", "--out-dir", str(tmp_path)]
    assert tune.main(argv) == 0
    (json_path,) = tmp_path.glob("gemv_tune-test_*.json")
    results = json.loads(json_path.read_text())["results"]
    grid = [r for r in results if r["options"]]
    assert len(grid) == 4 + 3 and len({r["setting"] for r in grid}) == len(grid)
    assert all(r["status"].startswith("ok") for r in results), [r["status"] for r in results]
    assert [r["phase"] for r in grid] == ["coarse"] * 4 + ["refine"] * 3
    coarse = [(r["options"]["use_dot"], r["options"]["num_stages"], r["options"]["x_tile_load"]) for r in grid[:4]]
    assert coarse == [(False, 1, False), (False, 1, True), (False, 3, True), (True, 3, False)]
    assert grid[1]["setting"].endswith("-xt") and not grid[0]["setting"].endswith("-xt")
    # The fake times fall call by call: the last refined setting is the fastest.
    table = json_path.with_suffix(".md").read_text()
    assert f"| tiny | int8 | 2 | 1000.0 | 999.0 | 998.0 | {grid[-1]['setting']} |" in table
