"""The GEMV's CUDA-core loop as compiled for an H100/H200 (CPU: compiled for ``sm_90``, not run).

This records the arguments that :func:`~omni_kernels.quant.triton_gemv.launch_weight_only_gemv`
launches the kernel with (CPU tensors, nothing runs), compiles the kernel from them in a fresh
process with Triton's interpreter off, and reads the PTX:

* ``num_stages`` reaches the ``M <= 4`` loop: Triton software-pipelines the loads of a loop
  without ``tl.dot`` only when the loop itself carries ``num_stages`` (``tl.range``); the launch
  option alone left one weight tile in flight per program whatever ``num_stages`` said. Looked
  for: ``cp.async`` (the pipelined copy), absent for the default (``num_stages=None``) and
  ``num_stages=1``, present for ``num_stages=3`` on both inner-product paths.
* ``x_tile_load=True`` reads ``x`` in the weight tile's layout: the default loads ``x`` as a
  ``[BLOCK_K]`` vector that Triton moves into the tile's layout through shared memory, with
  block-wide barriers (``bar.sync``) and ``ld.shared`` in every loop step; with the option the
  loop has neither (default tiles, K a multiple of ``BLOCK_K``, not pipelined).
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
import json, re, sys
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


def loop_bodies(ptx):
    # PTX of each loop: from a label to a later branch back to it.
    lines = ptx.splitlines()
    labels = {found.group(1): index for index, line in enumerate(lines)
              if (found := re.match(r"(\$L__\w+):", line.strip()))}
    bodies = []
    for index, line in enumerate(lines):
        branch = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        if branch and labels.get(branch.group(1), index) < index:
            bodies.append("\n".join(lines[labels[branch.group(1)] : index + 1]))
    return bodies


def ptx_of(rows, dtype, **knobs):
    launches.clear()
    x = torch.randn(rows, 1024, dtype=dtype)
    w_q = torch.randint(-127, 128, (256, 1024), dtype=torch.int8)
    w_scale = torch.rand(256, dtype=torch.float32)
    triton_gemv.launch_weight_only_gemv(x, w_q, w_scale, None, split_k=1, **knobs)
    kernel, args, kwargs = launches[0]
    return compiled_ptx(kernel, args, kwargs)


triton_gemv.wrap_triton = RecordLaunch
pipelined = {}
for rows, num_stages in ((1, None), (1, 1), (1, 3), (2, 3), (8, 3)):
    pipelined[f"M{rows}-stages{num_stages}"] = "cp.async" in ptx_of(rows, torch.float16, num_stages=num_stages)
loop_shared_memory = {}
for rows, dtype in ((1, torch.bfloat16), (2, torch.bfloat16), (4, torch.float16)):
    for x_tile_load in (False, True):
        loops = loop_bodies(ptx_of(rows, dtype, x_tile_load=x_tile_load))
        loop_shared_memory[f"M{rows}-{str(dtype)[6:]}-x_tile_load{x_tile_load}"] = dict(
            loops=len(loops), barriers=sum(len(re.findall(r"\bbar(?:rier)?\.sync", body)) for body in loops),
            shared_loads=sum(body.count("ld.shared") for body in loops))
print(json.dumps(dict(pipelined=pipelined, loop_shared_memory=loop_shared_memory)))
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


@pytest.fixture(scope="module")
def compiled():
    """The script's findings: ``pipelined`` (cp.async in the PTX, by case) and
    ``loop_shared_memory`` (loops, their barriers and shared-memory loads, by case)."""
    reason = _cuda_compiler_reason()
    if reason is not None:
        pytest.skip(reason)
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_num_stages_pipelines_the_cuda_core_loop(compiled):
    pipelined = compiled["pipelined"]
    # The default and one stage: one weight tile in flight (the default's code is unchanged).
    assert pipelined["M1-stagesNone"] is False
    assert pipelined["M1-stages1"] is False
    # Three stages: cp.async copies on the CUDA-core path (M = 1, 2) as on the tl.dot path (M = 8).
    assert pipelined["M1-stages3"] is True
    assert pipelined["M2-stages3"] is True
    assert pipelined["M8-stages3"] is True


@pytest.mark.parametrize("case", ["M1-bfloat16", "M2-bfloat16", "M4-float16"])
def test_x_tile_load_takes_shared_memory_out_of_the_loop(compiled, case):
    default = compiled["loop_shared_memory"][f"{case}-x_tile_loadFalse"]
    tiled = compiled["loop_shared_memory"][f"{case}-x_tile_loadTrue"]
    assert default["loops"] == tiled["loops"] == 1
    # The default load moves x through shared memory each step; the tile-shaped load does not.
    assert default["barriers"] > 0 and default["shared_loads"] > 0, default
    assert tiled["barriers"] == 0 and tiled["shared_loads"] == 0, tiled
