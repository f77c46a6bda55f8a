"""bench/attention.py on the CPU: the lossy crossover sweep's arithmetic and the auto-table
entry it writes (the timings themselves need a GPU)."""

from __future__ import annotations

import pytest

from omni_kernels.attention import selection

ENV = dict(device="NVIDIA H200", arch="sm90", utc="2026-12-01T00:00:00+00:00", git_commit="abc1234",
           torch="2.11.0+cu130", cuda="13.0", cudnn=91900, python="3.12.3", packages={"triton": "3.6.0"},
           dtype="bf16")


@pytest.fixture(scope="module")
def bench():
    from bench import attention

    return attention


def _rows(bench, ratios: dict[str, list[float | None]]):
    """Rows as _run_shape returns them: ``ratios[backend][i]`` at the i-th swept length
    (``None``: the backend could not take that length)."""
    rows = []
    for i, shape in enumerate(bench.sweep_shapes()):
        rows.append(dict(shape=shape.name, backend=bench.BASELINE, status="ok", ratio_vs_cudnn=1.0))
        for name, values in ratios.items():
            if values[i] is None:
                rows.append(dict(shape=shape.name, backend=name, status="ineligible: Skv % 64"))
            else:
                rows.append(dict(shape=shape.name, backend=name, status="ok", ratio_vs_cudnn=values[i]))
    return rows


def test_sweep_lengths_span_the_model_shapes(bench):
    lengths = [s.seq_q for s in bench.sweep_shapes()]
    assert lengths == sorted(lengths) and all(s.seq_q == s.seq_kv for s in bench.sweep_shapes())
    assert lengths[0] < bench.SHAPES["flux"].seq_q and lengths[-1] == bench.SHAPES["wan480"].seq_q
    assert bench.SHAPES["qwen"].seq_q in lengths


def test_crossover_is_where_the_gain_holds_for_every_longer_length(bench):
    n = len(bench.SWEEP_LENGTHS)
    lengths = list(bench.SWEEP_LENGTHS)
    rows = _rows(bench, {
        # loses short, wins from the 5th length on, but dips below the bar at the 4th
        "omni_sage_sm90": [0.6, 0.9, 1.2, 1.0, 1.1, 1.3, 1.4, 1.5],
        # never reaches the bar at the longest length: no crossover
        "omni_sage": [0.5] * (n - 1) + [1.04],
        # cannot take some lengths: the crossover starts after the last gap
        "sageattention": [1.5, None, 1.6, 1.6, 1.7, 1.8, 1.8, 1.9],
    })
    got = bench.lossy_crossovers(bench.sweep_shapes(), rows, ["omni_sage_sm90", "omni_sage", "sageattention"])
    assert got == {"omni_sage_sm90": lengths[4], "omni_sage": None, "sageattention": lengths[2]}
    # exactly the bar counts as a gain
    rows = _rows(bench, {"omni_sage_sm90": [bench.SWEEP_MIN_GAIN] * n})
    assert bench.lossy_crossovers(bench.sweep_shapes(), rows, ["omni_sage_sm90"]) == {
        "omni_sage_sm90": lengths[0]}


def test_lossy_entry_keeps_the_lossless_ranking_and_gates_auto(bench, tmp_path, monkeypatch):
    import json

    previous = {"source": "MEASURED earlier", "ranking": ["sageattention", "sdpa_cudnn", "omni_triton",
                                                          "sdpa_math"],
                "median_tflops": {"sdpa_cudnn": 576.2}, "lossy_listed": ["sageattention"]}
    n = len(bench.SWEEP_LENGTHS)
    rows = _rows(bench, {"omni_sage_sm90": [0.8, 0.9] + [1.4] * (n - 2), "omni_sage": [0.7] + [1.2] * (n - 1),
                         "sageattention": [0.5] * n})
    shapes = bench.sweep_shapes()
    crossovers = bench.lossy_crossovers(shapes, rows, ["omni_sage_sm90", "omni_sage", "sageattention"])
    entry = bench.lossy_table_entry(ENV, previous, shapes, rows, crossovers)
    # the faster one at the longest length first; sageattention (no crossover) leaves the ranking
    assert entry["ranking"] == ["omni_sage_sm90", "omni_sage", "sdpa_cudnn", "omni_triton", "sdpa_math"]
    assert entry["lossy_listed"] == ["omni_sage_sm90", "omni_sage"]
    assert entry["lossy_min_seq"] == {"omni_sage_sm90": bench.SWEEP_LENGTHS[2],
                                      "omni_sage": bench.SWEEP_LENGTHS[1]}
    assert entry["source"] == "MEASURED earlier" and entry["median_tflops"] == {"sdpa_cudnn": 576.2}
    assert "--lossy-sweep" in entry["lossy_source"] and "sageattention (no crossover)" in entry["lossy_source"]
    # the registry reads it back: lossy backends ranked first, each behind its crossover
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"archs": {"sm90": entry}}))
    monkeypatch.setenv("OMNI_ATTENTION_AUTO_TABLE", str(table))
    selection.reload_auto_table()
    try:
        assert selection.auto_ranking("sm90", allow_lossy=True)[:3] == ["omni_sage_sm90", "omni_sage", "sdpa_cudnn"]
        assert selection.auto_ranking("sm90")[0] == "sdpa_cudnn"
        assert selection.lossy_min_seq("sm90") == entry["lossy_min_seq"]
    finally:
        monkeypatch.delenv("OMNI_ATTENTION_AUTO_TABLE")
        selection.reload_auto_table()


def test_lossless_rerun_keeps_the_sweep(bench):
    """A later lossless-only --write-auto-table run re-ranks the lossless backends and keeps
    the sweep's lossy backends and crossovers in front."""
    previous = {"ranking": ["omni_sage_sm90", "sdpa_cudnn", "sdpa_math"], "lossy_listed": ["omni_sage_sm90"],
                "lossy_min_seq": {"omni_sage_sm90": 9216}, "lossy_source": "MEASURED by --lossy-sweep"}
    shapes = [bench.SHAPES["flux"], bench.SHAPES["wan720"]]
    rows = [dict(shape=s.name, backend=b, status="ok", tflops=t)
            for s in shapes for b, t in (("sdpa_cudnn", 600.0), ("omni_triton", 500.0), ("omni_sage_sm90", 800.0))]
    entry = bench._table_entry(ENV, shapes, rows, False, previous)
    assert entry["ranking"][:3] == ["omni_sage_sm90", "sdpa_cudnn", "omni_triton"]
    assert entry["lossy_listed"] == ["omni_sage_sm90"]
    assert entry["lossy_min_seq"] == {"omni_sage_sm90": 9216}
    assert entry["lossy_source"] == "MEASURED by --lossy-sweep"
    assert "omni_sage_sm90" not in entry["median_tflops"]


def test_sweep_refuses_without_a_lossy_backend(bench, capsys, monkeypatch):
    monkeypatch.setattr(bench.harness, "gpu_refusal", lambda what: None)
    assert bench.main(["--lossy-sweep", "--backends", "sdpa_cudnn", "sdpa_math"]) == 2
    assert "needs at least one lossy backend" in capsys.readouterr().err


def test_sweep_refuses_to_write_an_arch_without_a_lossless_entry(bench, capsys, monkeypatch, tmp_path):
    """The sweep writes only the lossy part of an arch's entry: with no lossless ranking measured
    there yet it refuses up front (before any timing) and leaves the table as it was."""
    monkeypatch.setattr(bench.harness, "gpu_refusal", lambda what: None)
    monkeypatch.setattr(bench, "_environment", lambda: dict(ENV, arch="sm99"))
    table = tmp_path / "auto_table.json"
    table.write_text('{"format": 1, "archs": {"sm90": {"ranking": ["sdpa_cudnn"]}}}\n')
    before = table.read_text()
    code = bench.main(["--lossy-sweep", "--backends", "sdpa_cudnn", "omni_sage", "--write-auto-table",
                       "--auto-table-path", str(table), "--out-dir", str(tmp_path)])
    assert code == 2
    assert "has no entry for sm99 yet" in capsys.readouterr().err
    assert table.read_text() == before



def test_dit_inputs_have_the_outliers_and_randn_inputs_are_unchanged(bench):
    """--inputs: randn keeps the generator sequence of before (recorded runs stay comparable);
    dit gives DiT-like activations (K's large per-channel bias, Q's outlier channels), in the
    requested layout, Sq and Skv apart."""
    import torch

    shape = bench.Shape("tiny", "a test shape", batch=1, heads=2, seq_q=48, seq_kv=80, head_dim=64)
    q, k, v = bench._make_inputs(shape, torch.float32, "bhsd", 3, "randn", device="cpu")
    gen = torch.Generator().manual_seed(3)
    expected = [torch.randn((1, 2, n, 64), generator=gen) for n in (48, 80, 80)]
    for got, want in zip((q, k, v), expected):
        assert torch.equal(got, want)
    q, k, v = bench._make_inputs(shape, torch.float32, "bshd", 3, "dit", device="cpu")
    assert q.shape == (1, 48, 2, 64) and k.shape == v.shape == (1, 80, 2, 64)
    channel_mean = k.mean(dim=(0, 1, 2)).abs()
    assert (channel_mean > 5).sum().item() == 4, "K's bias on four channels"
    assert channel_mean.sort().values[:-4].max().item() < 1.5
    rms = q.pow(2).mean(dim=(0, 1, 2)).sqrt()
    assert (rms > 2.5).sum().item() == 3, "Q's three outlier channels"
    # self-attention: q, k, v from one call, the same outliers
    square = bench.Shape("sq", "a test shape", batch=1, heads=2, seq_q=80, seq_kv=80, head_dim=64)
    q2, k2, v2 = bench._make_inputs(square, torch.float32, "bhsd", 3, "dit", device="cpu")
    assert q2.shape == k2.shape == v2.shape == (1, 2, 80, 64)
    assert (k2.mean(dim=(0, 1, 2)).abs() > 5).sum().item() == 4
    assert (q2.pow(2).mean(dim=(0, 1, 2)).sqrt() > 2.5).sum().item() == 3
    with pytest.raises(ValueError, match=r"inputs must be one of \['dit', 'randn'\]; got 'gauss'"):
        bench._make_inputs(shape, torch.float32, "bhsd", 3, "gauss", device="cpu")
    assert bench.parse_args(["--inputs", "dit"]).inputs == "dit"
    assert bench.parse_args([]).inputs == "randn"
