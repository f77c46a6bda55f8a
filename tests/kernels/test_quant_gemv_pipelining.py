"""The GEMV's ``num_stages`` knob reaches its CUDA-core loop (CPU: compiled for sm_90, not run).

Triton software-pipelines the loads of a loop without ``tl.dot`` only when the loop itself
carries ``num_stages`` (``tl.range``); the launch option alone left the ``M <= 4`` loop with one
weight tile in flight per program whatever ``num_stages`` said. This test records the arguments
that :func:`~omni_kernels.quant.triton_gemv.launch_weight_only_gemv` launches the kernel with
(CPU tensors, nothing runs), compiles the kernel for an H100/H200 (``sm_90``) from them in a
fresh process with Triton's interpreter off, and looks for ``cp.async`` (the pipelined copy)
in the PTX: absent for the default (``num_stages=None``, unchanged) and ``num_stages=1``,
present for ``num_stages=3`` on both inner-product paths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

COMPILE_SCRIPT = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from omni_kernels.quant import triton_gemv

TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int8: "i8",
                torch.float8_e4m3fn: "fp8e4nv"}
launches = []


class RecordLaunch:
    # Stands in for torch.library.wrap_triton: keeps what the launcher would launch.
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))


def compiled_ptx(kernel, args, kwargs):
    # Specialize as Triton's JIT does for aligned tensors: pointers and ints divisible by 16,
    # ints equal to 1 as constants.
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    signature, constexprs, attrs = {}, dict(kwargs), {}
    for index, (name, value) in enumerate(zip(kernel.arg_names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif value == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    for name in kwargs:
        signature[name] = "constexpr"
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


triton_gemv.wrap_triton = RecordLaunch
result = {}
k, n = 1024, 256
for rows, num_stages in ((1, None), (1, 1), (1, 3), (2, 3), (8, 3)):
    launches.clear()
    x = torch.randn(rows, k, dtype=torch.float16)
    w_q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    w_scale = torch.rand(n, dtype=torch.float32)
    triton_gemv.launch_weight_only_gemv(x, w_q, w_scale, None, num_stages=num_stages, split_k=1)
    kernel, args, kwargs = launches[0]
    result[f"M{rows}-stages{num_stages}"] = "cp.async" in compiled_ptx(kernel, args, kwargs)
print(json.dumps(result))
"""


def _cuda_compiler_reason() -> str | None:
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as exc:
        return f"triton's CUDA backend is not importable: {exc}"
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists() and not os.environ.get("TRITON_PTXAS_PATH"):
        return f"no ptxas at {ptxas} and TRITON_PTXAS_PATH unset"
    return None


@pytest.mark.skipif(_cuda_compiler_reason() is not None, reason=str(_cuda_compiler_reason()))
def test_num_stages_pipelines_the_cuda_core_loop():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    pipelined = json.loads(done.stdout.strip().splitlines()[-1])
    # The default and one stage: one weight tile in flight (the default's code is unchanged).
    assert pipelined["M1-stagesNone"] is False
    assert pipelined["M1-stages1"] is False
    # Three stages: cp.async copies on the CUDA-core path (M = 1, 2) as on the tl.dot path (M = 8).
    assert pipelined["M1-stages3"] is True
    assert pipelined["M2-stages3"] is True
    assert pipelined["M8-stages3"] is True
