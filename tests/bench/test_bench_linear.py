"""bench/linear.py's shape and variant selection and its tables, on the CPU (the timings need a
GPU): the opt-in modulation GEMV shapes leave the default run as it was."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench():
    from bench import linear

    return linear


def test_default_shapes_unchanged_and_modulation_shapes_opt_in(bench):
    assert bench.parse_args([]).shapes == ["flux", "wan"]
    assert bench.parse_args(["--shapes", "flux-adaln"]).shapes == ["flux-adaln"]
    shapes = {(s.name, s.m, s.k, s.n) for s in bench.SHAPES["flux-adaln"]}
    assert shapes == {
        ("flux-adaln-double-M1", 1, 3072, 18432), ("flux-adaln-double-M2", 2, 3072, 18432),
        ("flux-adaln-single-M1", 1, 3072, 9216), ("flux-adaln-single-M2", 2, 3072, 9216),
    }


def test_variants_per_shape(bench):
    from omni_kernels.quant import GEMV_MAX_M

    assert bench.GEMV_MAX_M == GEMV_MAX_M
    variants = ["bf16", *[v for v in bench.VARIANTS if v != "bf16"]]
    flux = bench._variants_for("flux", bench.SHAPES["flux"][0], variants)
    wan = bench._variants_for("wan", bench.SHAPES["wan"][0], variants)
    gemv = {"omni-fp8-wo-triton_gemv", "omni-int8-wo-triton_gemv"}
    gelu = {"bf16+gelu", "omni-fp8+gelu"}
    # The large-M groups measure what they measured before: no GEMV rows (M > 16); the "+gelu"
    # rows only at the down projections, whose input is a GELU's output.
    assert not gemv & set(flux) and not gemv & set(wan)
    assert flux == [v for v in variants if v not in gemv | gelu]
    assert [s.name for group in ("flux", "wan") for s in bench.SHAPES[group] if s.after_gelu] == [
        "flux-12288x3072", "wan14b-13824x5120"]
    down = bench._variants_for("flux", bench.SHAPES["flux"][2], variants)
    assert gelu <= set(down) and down == [v for v in variants if v not in gemv]
    adaln = bench._variants_for("flux-adaln", bench.SHAPES["flux-adaln"][0], variants)
    assert adaln == ["bf16", "omni-fp8", "omni-int8", "omni-fp8-wo-aten", "omni-fp8-wo-triton",
                     "omni-int8-wo-aten", "omni-int8-wo-triton", "omni-fp8-wo-triton_gemv",
                     "omni-int8-wo-triton_gemv"]


def test_weight_bytes_and_gemv_table(bench):
    shape = bench.SHAPES["flux-adaln"][0]
    assert bench._weight_bytes("bf16", shape) == 2 * 3072 * 18432
    assert bench._weight_bytes("omni-int8-wo-triton_gemv", shape) == 3072 * 18432 + 4 * 18432
    assert bench._weight_bytes("quant-cuda", shape) is None
    env = dict(device="NVIDIA H200", torch="2.11", cuda="13.0", packages={}, git_commit="abc", utc="now",
               command="python3 bench/linear.py --shapes flux-adaln")
    common = dict(shape=shape.name, model=shape.model, m=shape.m, k=shape.k, n=shape.n, status="ok", rel_err=1e-3)
    rows = [dict(common, variant="bf16", median_us=40.0, tflops=0.003, weight_gbps=2831.0, host_us=12.0,
                 padded_us=39.0),
            dict(common, variant="omni-int8-wo-triton_gemv", median_us=20.0, tflops=0.006, weight_gbps=2835.0,
                 speedup_vs_bf16=2.0, host_us=60.0, padded_us=13.0, padded_speedup_vs_bf16=3.0),
            dict(common, variant="omni-fp8-wo-triton_gemv", median_us=30.0, tflops=0.004, weight_gbps=1900.0)]
    table = bench._markdown(env, rows, [])
    assert ("| variant | median us | weight GB/s | speedup vs bf16 | rel err | host us | padded us "
            "| padded speedup | status |") in table
    assert "| omni-int8-wo-triton_gemv | 20.0 | 2835 | 2.00x | 1.00e-03 | 60 | 13.0 | 3.00x | ok |" in table
    assert "| omni-fp8-wo-triton_gemv | 30.0 | 1900 | - | 1.00e-03 | - | - | - | ok |" in table  # not measured
    large = dict(common, shape="flux-3072x3072", m=4608, n=3072, variant="bf16", median_us=100.0, tflops=800.0)
    assert "| variant | median us | TFLOP/s |" in bench._markdown(env, [large], [])


def _on_cpu(bench, monkeypatch):
    """_run_linear_shape on the CPU: no CUDA syncs, fixed host and padded times (each test
    scripts the timer itself)."""
    import torch

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench.harness, "host_us", lambda call: 5.0)
    monkeypatch.setattr(bench.harness, "padded_us", lambda call, host: 7.0)


def test_rounds_time_variants_in_turn_and_report_the_median(bench, monkeypatch):
    """--rounds: every variant of a shape is timed once per round, in turn, and its figure is the
    median of its rounds' medians, so one slow spell cannot decide a ratio. Run on the CPU with
    the timer replaced by a script of figures (bf16 twice: two rows, the second the baseline)."""
    _on_cpu(bench, monkeypatch)
    # round 1: first row 100, second 50; round 2: 90 and a slow spell (300); round 3: 110, 55
    script = iter([100.0, 50.0, 90.0, 300.0, 110.0, 55.0])
    monkeypatch.setattr(bench, "_bench", lambda call: next(script))
    shape = bench.LinearShape("tiny", "test", 8, 32, 16)
    rows = bench._run_linear_shape(shape, ["bf16", "bf16"], seed=0, budget=bench._Budget(1e9, 1e9), rounds=3)
    assert [r["round_medians_us"] for r in rows] == [[100.0, 90.0, 110.0], [50.0, 300.0, 55.0]]
    assert [r["median_us"] for r in rows] == [100.0, 55.0]
    assert rows[0]["speedup_vs_bf16"] == 55.0 / 100.0 and rows[0]["host_us"] == 5.0
    assert all(r["status"] == "ok" and "is_layer" not in r for r in rows)
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])


def test_gelu_rows_compare_with_bf16_gelu(bench, monkeypatch):
    """At a down projection, "+gelu" rows take x as the GELU's input: their error is against
    GELU(x) @ W^T + b and their speedup against "bf16+gelu", not against the plain layer."""
    _on_cpu(bench, monkeypatch)
    script = iter([100.0, 150.0])  # bf16, then bf16+gelu
    monkeypatch.setattr(bench, "_bench", lambda call: next(script))
    shape = bench.LinearShape("tiny-down", "test", 8, 64, 16, after_gelu=True)
    rows = bench._run_linear_shape(shape, ["bf16", "bf16+gelu"], seed=0, budget=bench._Budget(1e9, 1e9))
    plain, gelu = rows
    assert plain["speedup_vs_bf16"] == 1.0 and gelu["speedup_vs_bf16"] == 1.0  # each its own baseline
    # bf16 rounding only: each row is compared with its own float32 reference
    assert plain["rel_err"] < 1e-2 and gelu["rel_err"] < 1e-2


def test_later_rounds_time_each_rows_own_layer(bench, monkeypatch):
    """Every round calls each row's own layer (not the one the loop built last): on the CPU the
    timer is replaced by the sum of the call's output, which differs between an INT8 and an FP8
    weight-only layer and must repeat across one row's rounds."""
    import torch

    _on_cpu(bench, monkeypatch)
    monkeypatch.setattr(bench, "_bench", lambda call: float(call().double().sum()))
    shape = bench.LinearShape("tiny", "test", 8, 64, 32)
    with torch.no_grad():
        rows = bench._run_linear_shape(shape, ["bf16", "omni-int8-wo-aten", "omni-fp8-wo-aten"], seed=0,
                                       budget=bench._Budget(1e9, 1e9), rounds=3)
    assert [r["status"] for r in rows] == ["ok"] * 3, rows
    sums = [r["round_medians_us"] for r in rows]
    assert all(len(set(s)) == 1 for s in sums), sums
    assert len({s[0] for s in sums}) == 3, sums
