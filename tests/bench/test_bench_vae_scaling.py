"""bench/vae_parallel_scaling.py's own logic: 2 gloo ranks under torchrun, the tiny VAEs on CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _pythonpath() -> str:
    """The repository first, so that the script imports this checkout's omni packages."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> Path:
    """One torchrun of both tiny VAEs (process start-up and imports are most of its time)."""
    out_dir = tmp_path_factory.mktemp("vae_scaling")
    env = dict(os.environ, PYTHONPATH=_pythonpath(), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(REPO / "bench" / "vae_parallel_scaling.py"), "--smoke", "--model", "wan", "flux",
           "--halo-backend", "torch", "--warmup", "0", "--iters", "1", "--out-dir", str(out_dir)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out_dir


@pytest.mark.parametrize("model", ["wan", "flux"])
def test_vae_scaling_bench_two_ranks_writes_rows(smoke_run, model):
    (path,) = smoke_run.glob(f"vae_parallel_scaling_{model}-smoke_x2_cpu_*.json")
    record = json.loads(path.read_text())
    assert record["world_size"] == 2 and record["dtype"] == "float32"
    rows = {row["run"]: row for row in record["rows"]}
    assert list(rows) == ["1-GPU untiled", "1-GPU tiled", "tile x2", "spatial x2"]
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["decode_ms"] > 0 and all(p > 0 for p in row["peak_bytes"]), row
    untiled, tiled, tile, spatial = rows.values()
    # The smoke tiles really tile: the tiled decode differs from the untiled one, so "tile equals
    # the tiled decode" below is not "tile equals any decode".
    assert tiled["rel_err_vs_untiled"] > 1e-2, tiled
    for row, base in ((tile, tiled), (spatial, untiled)):
        assert len(row["rank_ms"]) == 2 and len(row["peak_bytes"]) == 2
        assert row["decode_ms"] == pytest.approx(max(row["rank_ms"]), abs=1e-3)
        assert row["speedup"] == pytest.approx(base["decode_ms"] / row["decode_ms"], rel=1e-2)
        assert row["peak_fraction"] == pytest.approx(max(row["peak_bytes"]) / base["peak_bytes"][0], rel=1e-3)
    assert tile["baseline"] == "1-GPU tiled" and tile["rel_err"] < 1e-6, tile
    assert tile["rel_err_vs_untiled"] == pytest.approx(tiled["rel_err_vs_untiled"], rel=1e-3)
    # spatial mode equals the untiled decode (fp32 reductions in another order)
    assert spatial["baseline"] == "1-GPU untiled" and spatial["rel_err"] < 1e-5, spatial
    # each rank decodes half the rows: its peak is well under the single decode's
    assert spatial["peak_fraction"] < 0.85, spatial
    markdown = path.with_suffix(".md").read_text()
    assert "| spatial x2 | 1-GPU untiled |" in markdown and "| tile x2 | 1-GPU tiled |" in markdown
