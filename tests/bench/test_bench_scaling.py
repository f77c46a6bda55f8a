"""bench/parallel_scaling.py's own logic: 2 gloo ranks under torchrun, the tiny Flux model on CPU;
its true-CFG step (the CFG strategies' unit of work) in one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _pythonpath() -> str:
    """The repository first, so that the script imports this checkout's omni packages."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_scaling_bench_two_ranks_writes_rows(tmp_path):
    env = dict(os.environ, PYTHONPATH=_pythonpath(), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
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
        assert row["status"] == "ok" and row["measures"] == "forward" and row["ms"] > 0 and len(row["rank_ms"]) == 2
        assert row["baseline_ms"] == round(record["baseline_ms"], 3) and row["forwards_per_rank"] == [1, 1]
        assert row["rel_err"] < 1e-5, row
        assert abs(row["efficiency"] - row["speedup"] / 2) < 1e-3
    assert rows["usp"]["status"].startswith("skipped: needs an even world size >= 4")
    assert path.with_suffix(".md").exists()


def test_scaling_bench_with_the_acceleration_stack(tmp_path):
    """--compile and --quant apply to the baselines and every strategy alike, CFG included (through
    accelerate, undone between runs); the tags name them in the file name."""
    env = dict(os.environ, PYTHONPATH=_pythonpath(), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(REPO / "bench" / "parallel_scaling.py"), "--smoke", "--model", "flux", "--strategies", "ulysses", "tp", "cfg",
           "--compile", "--compile-backend", "eager", "--quant", "int8", "--warmup", "1", "--iters", "1",
           "--attention", "sdpa_math", "--out-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("parallel_scaling_flux-smoke-compile-int8_x2_cpu_*.json")
    record = json.loads(path.read_text())
    assert record["args"]["compile"] and record["args"]["quant"] == "int8"
    for row in record["rows"]:
        # the quantized baseline and the quantized parallel runs quantize the same weights
        assert row["status"] == "ok" and row["rel_err"] < 2e-2 and row["forwards_per_rank"] == [1, 1], row
    assert [row["measures"] for row in record["rows"]] == ["forward", "forward", "cfg_step"]
    assert "int8 W8A8 linears" in path.with_suffix(".md").read_text()


def _run_smoke(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=_pythonpath(), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(REPO / "bench" / "parallel_scaling.py"), "--smoke", *extra, "--warmup", "1", "--iters", "1",
           "--attention", "sdpa_math", "--out-dir", str(tmp_path)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def test_scaling_bench_cfg_step_two_ranks(tmp_path):
    """"cfg" splits the true-CFG step's two transformer calls over the 2 ranks (one forward each)
    and matches rank 0's plain 2-call step; "cfg_ulysses" needs 4 ranks and says so."""
    done = _run_smoke(tmp_path, "--model", "flux", "--strategies", "cfg", "cfg_ulysses")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("parallel_scaling_flux-smoke_x2_cpu_*.json")
    record = json.loads(path.read_text())
    rows = {row["strategy"]: row for row in record["rows"]}
    # only the CFG-step baseline was needed: the plain step computes both branches on rank 0
    assert record["baseline_ms"] is None and record["cfg_step_baseline_ms"] > 0
    assert record["baseline_forwards"] == {"cfg_step": 2}
    cfg = rows["cfg"]
    assert cfg["status"] == "ok" and cfg["measures"] == "cfg_step" and cfg["config"] == "cfg=2"
    assert cfg["baseline_ms"] == round(record["cfg_step_baseline_ms"], 3)
    assert cfg["forwards_per_rank"] == [1, 1], cfg  # each rank computed one branch
    assert cfg["rel_err"] < 1e-5, cfg
    assert abs(cfg["efficiency"] - cfg["speedup"] / 2) < 1e-3
    assert rows["cfg_ulysses"]["status"] == "skipped: needs an even world size >= 4, got 2"
    markdown = path.with_suffix(".md").read_text()
    assert "| cfg | cfg=2 | CFG step (cond + uncond) |" in markdown and "one true-CFG step" in markdown


@pytest.mark.parametrize("model", ["flux", "wan"])
def test_true_cfg_step_is_a_pipeline_for_cfg_parallelism(model):
    """The step guides as ``u + s * (c - u)`` of two plain forwards, and its call exposes the
    family's CFG arguments so that omni's CFG runtime takes it as a separate-call pipeline."""
    import inspect

    from bench.parallel_scaling import CFG_SCALE, negative_inputs, true_cfg_step
    from bench.pipeline import SMOKE_MODELS, build_transformer, forward_once, make_inputs
    from omni_diffusion.adapters import adapter_for
    from omni_diffusion.parallel.cfg_parallel import check_cfg_parallel

    spec = SMOKE_MODELS[model]
    transformer = build_transformer(spec, torch.device("cpu"), torch.float32)
    conditional = make_inputs(spec, torch.device("cpu"), torch.float32)
    unconditional = negative_inputs(conditional)
    step, arguments = true_cfg_step(transformer, conditional, unconditional)

    cond = forward_once(transformer, conditional)
    uncond = forward_once(transformer, unconditional)
    assert (cond - uncond).abs().max() > 1e-3  # the negative prompt changes the prediction
    expected = uncond + CFG_SCALE * (cond - uncond)
    torch.testing.assert_close(forward_once(step, arguments), expected, rtol=1e-6, atol=1e-6)

    adapter = adapter_for(step)
    assert check_cfg_parallel(adapter, step) == "separate"
    bound = inspect.signature(type(step).__call__).bind(step, **arguments).arguments
    assert float(bound[adapter.cfg.guidance_scale_argument]) == CFG_SCALE > 1
    assert all(bound[name] is not None for name in adapter.cfg.negative_arguments)
