"""bench/parallel_scaling.py's own logic: 2 gloo ranks under torchrun, the tiny Flux model on CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_scaling_bench_two_ranks_writes_rows(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(REPO / "bench" / "parallel_scaling.py"), "--smoke", "--model", "flux",
           "--strategies", "ulysses", "usp", "tp", "--warmup", "1", "--iters", "1",
           "--attention", "sdpa_math", "--out-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("parallel_scaling_flux-smoke_x2_cpu_*.json")
    record = json.loads(path.read_text())
    rows = {row["strategy"]: row for row in record["rows"]}
    assert record["world_size"] == 2 and record["baseline_ms"] > 0
    for name in ("ulysses", "tp"):
        row = rows[name]
        assert row["status"] == "ok" and row["forward_ms"] > 0 and len(row["rank_ms"]) == 2
        assert row["rel_err"] < 1e-5, row
        assert abs(row["efficiency"] - row["speedup"] / 2) < 1e-3
    assert rows["usp"]["status"].startswith("skipped: needs an even world size >= 4")
    assert path.with_suffix(".md").exists()


def test_scaling_bench_with_the_acceleration_stack(tmp_path):
    """--compile and --quant apply to the baseline and every strategy alike (through accelerate,
    undone between runs); the tags name them in the file name."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(REPO / "bench" / "parallel_scaling.py"), "--smoke", "--model", "flux", "--strategies", "ulysses", "tp",
           "--compile", "--compile-backend", "eager", "--quant", "int8", "--warmup", "1", "--iters", "1",
           "--attention", "sdpa_math", "--out-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("parallel_scaling_flux-smoke-compile-int8_x2_cpu_*.json")
    record = json.loads(path.read_text())
    assert record["args"]["compile"] and record["args"]["quant"] == "int8"
    for row in record["rows"]:
        # the quantized baseline and the quantized parallel runs quantize the same weights
        assert row["status"] == "ok" and row["rel_err"] < 2e-2, row
    assert "int8 W8A8 linears" in path.with_suffix(".md").read_text()
