"""bench/quant_per_token.py on the CPU: the shapes, the table, and the refusal without a GPU (the
timings themselves need one)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "quant_per_token.py"


@pytest.fixture(scope="module")
def tune():
    spec = importlib.util.spec_from_file_location("quant_per_token", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_shapes_fit_the_cuda_kernel(tune):
    # csrc/quant reads rows in 16-byte vectors (8 values) and keeps at most 32768 values a row.
    assert set(tune.DEFAULT_SHAPES) <= set(tune.SHAPES)
    assert all(s.cols % 8 == 0 and s.cols <= 32768 for s in tune.SHAPES.values())


def test_markdown_table(tune):
    env = dict(device="NVIDIA H200", torch="2.11", cuda="13.0", packages={"triton": "3.6"}, git_commit="abc",
               utc="now", command="python3 bench/quant_per_token.py")
    shape = tune.SHAPES["tiny"]
    rows = [dict(shape="tiny", kind="plain", setting="cuda", us=10.0, gbps=100.0, status="ok"),
            dict(shape="tiny", kind="plain", setting="triton", us=8.0, gbps=125.0, status="ok"),
            dict(shape="tiny", kind="layernorm+adaln", setting="cuda", us=20.0, gbps=50.0, status="ok")]
    table = tune.markdown(env, [shape], rows, "bf16")
    assert "| triton | 8.0 | 125 | 1.25x | ok |" in table
    assert "## tiny (layernorm+adaln)" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu(tune):
    assert tune.main(["--shapes", "tiny"]) == 2
