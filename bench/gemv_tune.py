#!/usr/bin/env python3
"""Launch settings of omni's weight-only Triton GEMV at Flux's adaLN modulation shapes.

:func:`omni_kernels.quant.triton_gemv.launch_weight_only_gemv` (``y = x @ (w_q * w_scale)^T +
bias``, ``M <= 16`` rows, INT8 or FP8 e4m3 weights) reads half the bytes of bf16 cuBLAS at
Flux's modulation linears, yet the linear records (bench/results/INDEX.md) found it slower there.
This sweeps the launcher's knobs on the same inputs in one process, for each shape
(``flux-adaln-double`` 3072 -> 18432, ``flux-adaln-single`` 3072 -> 9216), weight dtype (INT8,
FP8) and row count (M = 1, 2):

* ``bf16``: ``F.linear`` on the unquantized weight (cuBLAS), the baseline; ``default``: the
  launcher without knobs (the reference for every setting's output); ``op``: the custom op
  ``QuantizedLinear`` calls (the difference is host overhead only);
* ``coarse``: a grid over the CUDA-core path (weight tiles of 4 to 16 KiB, 4 or 8 warps, 1 or
  3 stages, ``x_tile_load`` for the larger tiles: labels ``...-xt``) and the ``tl.dot`` path,
  pruned by :func:`prune_reason` and capped at ``--coarse-cap``;
* ``refine``: the neighbours (one knob one step away) of the ``--refine-top`` fastest, capped
  at ``--refine-cap``.

Kernels are compiled first in ``--jobs`` worker processes (into Triton's on-disk cache). Times:
median of ``triton.testing.do_bench`` (L2 flushed), launched outside ``wrap_triton``'s tracing
path as the op's eager and Inductor calls are; ``weight GB/s``, the weight's bytes over the
median; ``host us``, the launcher's CPU time a call (where it exceeds the flush's GPU time, the
default, ``op``, bf16 and each case's best are also timed behind a GPU sleep: ``padded us``);
``regs``/``spills``/``smem`` of the compiled kernel. A setting within 1e-5 relative L2 of the
default is ``ok``, one off by a bf16 rounding step in some values (K summed in another order)
``ok (one rounding step)``; anything else is reported as differing and never chosen as best.

Record: ``<out-dir>/gemv_tune[-<tag>]_<device>_<date>.json`` and ``.md`` (the grid, each
setting's timings and check); the table is printed.

    python3 bench/gemv_tune.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

if __package__:  # imported as bench.<script> (the tests)
    from bench import harness
    from bench import shapes as models
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import harness
    import shapes as models



@dataclass(frozen=True)
class Shape:
    name: str
    k: int
    n: int
    note: str


SHAPES = {
    s.name: s for s in (
        Shape("flux-adaln-double", models.FLUX.width, models.FLUX_ADALN["double"],
              "Flux.1 transformer_blocks.*.norm1(_context).linear"),
        Shape("flux-adaln-single", models.FLUX.width, models.FLUX_ADALN["single"],
              "Flux.1 single_transformer_blocks.*.norm.linear"),
        Shape("tiny", 256, 96, "smoke test"),
    )
}
DEFAULT_SHAPES = ("flux-adaln-double", "flux-adaln-single")
WEIGHT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# The activations' dtype (Flux runs in bf16); the CPU test runs the sweep in float16, as
# Triton's interpreter cannot do bfloat16.
X_DTYPE = torch.bfloat16
DEVICE = "cuda"
DEFAULT_ROWS = (1, 2)

# The knob values the sweep draws from (the launcher accepts more).
BLOCK_N_VALUES = (16, 32, 64, 128, 256)
BLOCK_K_VALUES = (64, 128, 256, 512)
NUM_WARPS_VALUES = (2, 4, 8)
NUM_STAGES_VALUES = (1, 2, 3, 4)
SPLIT_K_VALUES = (1, 2, 4, 8, 16)
# Where there is no GPU to ask (the grid functions' tests).
H200_SM_COUNT = 132
# The CUDA-core path keeps ROWS x block_n x block_k float32 accumulators; above this many a
# thread (of 255 registers) the compiler spills.
MAX_ACCUMULATORS_PER_THREAD = 128
# Pipelined weight (and x) tiles in shared memory; an H200 has 227 KiB a block.
MAX_PIPELINE_BYTES = 160 * 1024
# Splitting K is for column blocks too few to fill the GPU; more programs than this many per
# SM only add partial sums.
MAX_PROGRAMS_PER_SM = 4
# The rows the CUDA-core path takes (omni_kernels.quant.triton_gemv.FMA_MAX_ROWS).
FMA_MAX_ROWS = 4
# The tl.dot path's row tile (omni_kernels.quant.triton_gemv.GEMV_MAX_M).
DOT_ROWS = 16
# Bytes of one x value (bf16 on the GPU) in a pipelined x tile.
X_BYTES = 2

# (use_dot, (block_n, block_k) tiles, warps, stages, x_tile_load) of the coarse grid: the
# CUDA-core path at 4, 8 and 16 KiB of weight a loop step, in several aspect ratios (larger
# tiles are reached by refinement); the same path loading x in the weight tile's layout at the
# 8 and 16 KiB tiles around the launcher's defaults (32x256 at M=1, 16x256 at M=2), unpipelined
# (the case where it takes every barrier out of the loop; refinement tries stages and flips it
# on the fastest); the tl.dot path at 8 to 16 KiB. In this order, so that a cap cuts the tl.dot
# path first; pruning removes what a row count cannot hold (~38 settings at M=1, ~36 at M=2).
COARSE_PLAN = (
    (False, ((16, 256), (32, 128), (32, 256), (64, 128), (16, 512), (64, 256)), (4, 8), (1, 3), False),
    (False, ((16, 256), (32, 256), (64, 128), (16, 512)), (4, 8), (1,), True),
    (True, ((64, 128), (128, 128), (64, 256)), (4,), (3, 4), False),
)
COARSE_CAP = 40
REFINE_TOP = 5
REFINE_CAP = 20
# Outputs this close (relative L2) to the default's are the same result.
SAME_REL_L2 = 1e-5
# 16-bit outputs this close are the same sums in another order: rounding apart by one step
# everywhere is ~2e-3, and a few steps in values near zero (cancellation) far less.
SUMMATION_ORDER_REL_L2 = 2.0**-10


@dataclass(frozen=True)
class Setting:
    """One launch configuration: the launcher's keyword arguments."""

    use_dot: bool
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    x_tile_load: bool = False

    @property
    def label(self) -> str:
        path = "dot" if self.use_dot else "fma"
        split = f"-k{self.split_k}" if self.split_k > 1 else ""
        x_tile = "-xt" if self.x_tile_load else ""
        return f"{path}-{self.block_n}x{self.block_k}-w{self.num_warps}-s{self.num_stages}{split}{x_tile}"

    def options(self) -> dict:
        return dict(use_dot=self.use_dot, block_n=self.block_n, block_k=self.block_k, num_warps=self.num_warps,
                    num_stages=self.num_stages, split_k=self.split_k, x_tile_load=self.x_tile_load)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def fill_split(block_n: int, block_k: int, shape: Shape, sm_count: int = H200_SM_COUNT) -> int:
    """The smallest power-of-two ``split_k`` whose programs fill ``sm_count`` SMs (1 when the
    column blocks do), at most the number of ``block_k`` chunks and 16."""
    column_blocks = _cdiv(shape.n, block_n)
    limit = min(SPLIT_K_VALUES[-1], _cdiv(shape.k, block_k))
    split = 1
    while column_blocks * split < sm_count and split * 2 <= limit:
        split *= 2
    return split


def prune_reason(setting: Setting, rows: int, shape: Shape, sm_count: int = H200_SM_COUNT) -> str | None:
    """Why ``setting`` is left out at ``rows`` x ``shape`` (None: it is swept)."""
    threads = 32 * setting.num_warps
    tile = setting.block_n * setting.block_k
    if not setting.use_dot and rows > FMA_MAX_ROWS:
        return f"the CUDA-core path takes M <= {FMA_MAX_ROWS}"
    if setting.use_dot and setting.x_tile_load:
        return "x_tile_load is for the CUDA-core path"
    if setting.use_dot:
        # The weight tile as 16-bit values (two a register) plus the [16, block_n] accumulator.
        registers = (tile / 2 + DOT_ROWS * setting.block_n) / threads
    else:
        registers = rows * tile / threads
    if registers > MAX_ACCUMULATORS_PER_THREAD:
        return f"{registers:.0f} accumulator registers a thread (> {MAX_ACCUMULATORS_PER_THREAD}: spills)"
    if tile < 16 * threads:
        return "fewer 16-byte weight vectors than threads"
    if setting.block_k > max(BLOCK_K_VALUES[0], _next_power_of_two(shape.k)):
        return f"block_k {setting.block_k} wider than K={shape.k}"
    # x pipelined with the weight: a 16-row tile on the tl.dot path; with x_tile_load, one
    # [block_n, block_k] tile a row.
    x_bytes = DOT_ROWS * setting.block_k * X_BYTES if setting.use_dot else 0
    if setting.x_tile_load:
        x_bytes = rows * tile * X_BYTES
    if setting.num_stages > 1 and setting.num_stages * (tile + x_bytes) > MAX_PIPELINE_BYTES:
        return f"{setting.num_stages} stages of {tile + x_bytes} B exceed {MAX_PIPELINE_BYTES} B of shared memory"
    if setting.split_k > 1:
        column_blocks = _cdiv(shape.n, setting.block_n)
        if column_blocks >= sm_count:
            return f"split_k where {column_blocks} column blocks already fill {sm_count} SMs"
        if setting.split_k > _cdiv(shape.k, setting.block_k):
            return f"split_k {setting.split_k} above the {_cdiv(shape.k, setting.block_k)} block_k chunks of K"
        if column_blocks * setting.split_k > MAX_PROGRAMS_PER_SM * sm_count:
            return f"{column_blocks * setting.split_k} programs for {sm_count} SMs"
    return None


def coarse_grid(rows: int, shape: Shape, sm_count: int = H200_SM_COUNT, cap: int = COARSE_CAP) -> list[Setting]:
    """:data:`COARSE_PLAN` at ``rows`` x ``shape``, pruned, deduplicated, at most ``cap``."""
    grid: list[Setting] = []
    for use_dot, tiles, warps, stages, x_tile_load in COARSE_PLAN:
        for (block_n, block_k) in tiles:
            for num_warps in warps:
                for num_stages in stages:
                    setting = Setting(use_dot, block_n, block_k, num_warps, num_stages,
                                      fill_split(block_n, block_k, shape, sm_count), x_tile_load)
                    if setting not in grid and prune_reason(setting, rows, shape, sm_count) is None:
                        grid.append(setting)
    return grid[:cap]


def _step(values: tuple[int, ...], value: int, delta: int) -> int | None:
    index = values.index(value) + delta if value in values else -1
    return values[index] if 0 <= index < len(values) else None


def neighbours(setting: Setting, shape: Shape, sm_count: int = H200_SM_COUNT) -> list[Setting]:
    """Settings one knob away from ``setting``: ``x_tile_load`` flipped (CUDA-core path; first,
    so that a capped refinement tries it on every parent), block_n, block_k and warps one value
    up or down, every other stage count, ``split_k`` doubled or halved (a new tile gets its
    filling split)."""
    out: list[Setting] = [] if setting.use_dot else [replace(setting, x_tile_load=not setting.x_tile_load)]
    for field, values in (("block_n", BLOCK_N_VALUES), ("block_k", BLOCK_K_VALUES)):
        for delta in (-1, 1):
            value = _step(values, getattr(setting, field), delta)
            if value is not None:
                moved = replace(setting, **{field: value})
                out.append(replace(moved, split_k=fill_split(moved.block_n, moved.block_k, shape, sm_count)))
    for delta in (-1, 1):
        value = _step(NUM_WARPS_VALUES, setting.num_warps, delta)
        if value is not None:
            out.append(replace(setting, num_warps=value))
    out += [replace(setting, num_stages=s) for s in NUM_STAGES_VALUES if s != setting.num_stages]
    for delta in (-1, 1):
        value = _step(SPLIT_K_VALUES, setting.split_k, delta)
        if value is not None:
            out.append(replace(setting, split_k=value))
    return out


def refine_grid(ranked: list[Setting], measured: set[Setting], rows: int, shape: Shape,
                sm_count: int = H200_SM_COUNT, top: int = REFINE_TOP, cap: int = REFINE_CAP) -> list[Setting]:
    """Unmeasured, unpruned neighbours of the ``top`` first of ``ranked`` (fastest first), taken
    from each in turn so that every one of them gets some, at most ``cap``."""
    candidates = [neighbours(parent, shape, sm_count) for parent in ranked[:top]]
    out: list[Setting] = []
    for index in range(max((len(c) for c in candidates), default=0)):
        for options in candidates:
            if index < len(options):
                setting = options[index]
                if (setting not in measured and setting not in out
                        and prune_reason(setting, rows, shape, sm_count) is None):
                    out.append(setting)
                    if len(out) == cap:
                        return out
    return out


# --------------------------------------------------------------------------- inputs, checks


def make_inputs(shape: Shape, weight: str, rows: int, seed: int):
    """``x`` ``[rows, K]`` (:data:`X_DTYPE`) with 4 outlier channels (x20), the unquantized
    weight ``[N, K]`` in ``x``'s dtype, its per-channel quantization ``(w_q [N, K], w_scale [N]
    float32)`` and a bias ``[N]`` in ``x``'s dtype, on :data:`DEVICE`."""
    from omni_kernels.quant import quantize_weight

    device = DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, shape.k, device=device, generator=gen)
    x[:, torch.randperm(shape.k, device=device, generator=gen)[:4]] *= 20.0
    w = 0.05 * torch.randn(shape.n, shape.k, device=device, generator=gen)
    bias = 0.1 * torch.randn(shape.n, device=device, generator=gen)
    w_q, w_scale = quantize_weight(w, WEIGHT_DTYPES[weight])
    return x.to(X_DTYPE), w.to(X_DTYPE), w_q, w_scale, bias.to(X_DTYPE)


def _ordered_bits(y: torch.Tensor) -> torch.Tensor:
    """16-bit floats as integers whose differences count representable steps."""
    bits = y.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def compare_with_default(out: torch.Tensor, default: torch.Tensor) -> dict:
    """``rel_l2`` (float64) of ``out`` against ``default``, the most 16-bit rounding steps any
    value differs by (``max_steps``; None for float32 outputs), and a status."""
    rel = ((out.double() - default.double()).norm() / default.double().norm().clamp_min(1e-30)).item()
    steps = None
    if out.element_size() == 2:
        steps = int((_ordered_bits(out) - _ordered_bits(default)).abs().max().item()) if out.numel() else 0
    if rel <= SAME_REL_L2:
        status = "ok"
    elif steps is not None and steps <= 1 and torch.isfinite(out).all():
        status = "ok (one rounding step)"
    elif steps is not None and rel <= SUMMATION_ORDER_REL_L2 and torch.isfinite(out).all():
        status = f"ok (summation order: rel L2 {rel:.1e}, at most {steps} rounding steps)"
    else:
        status = f"differs from the default: rel L2 {rel:.2e}" + (f", {steps} rounding steps" if steps else "")
    return dict(rel_l2_vs_default=rel, max_steps_vs_default=steps, status=status)


# --------------------------------------------------------------------------- timing


def _sm_count() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _flush_us() -> float:
    """GPU time of do_bench's L2 flush (zeroing its buffer)."""
    import triton

    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    return statistics.median(harness.call_times_ms(cache.zero_, 10)) * 1e3


def _compiled_kernels() -> dict[int, object]:
    """The GEMV kernel's compiled variants in this process, by id (Triton's JIT caches)."""
    from omni_kernels.quant.triton_gemv import _weight_only_gemv_kernel

    found = {}
    for cache in getattr(_weight_only_gemv_kernel, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) and cache and isinstance(cache[0], dict) else {}
        for kernel in kernels.values():
            found[id(kernel)] = kernel
    return found


def _kernel_stats(kernel) -> dict:
    metadata = getattr(kernel, "metadata", None)
    return dict(regs=getattr(kernel, "n_regs", None), spills=getattr(kernel, "n_spills", None),
                smem=getattr(metadata, "shared", None))


# --------------------------------------------------------------------------- compilation workers

_WORKER_INPUTS: dict = {}


def _precompile(task: tuple) -> str | None:
    """Worker: launch the GEMV once with ``task``'s setting on inputs of the case's shapes and
    dtypes (so that Triton compiles the same specialization into its on-disk cache)."""
    shape_name, k, n, weight, rows, options = task
    try:
        from torch._library.triton import set_wrap_triton_enabled

        from omni_kernels.quant.triton_gemv import launch_weight_only_gemv

        key = (k, n, weight, rows)
        if key not in _WORKER_INPUTS:
            _WORKER_INPUTS[key] = (
                torch.zeros(rows, k, device="cuda", dtype=X_DTYPE),
                torch.empty(n, k, device="cuda", dtype=WEIGHT_DTYPES[weight]),  # values unused
                torch.ones(n, device="cuda", dtype=torch.float32),
                torch.zeros(n, device="cuda", dtype=X_DTYPE),
            )
        with set_wrap_triton_enabled(False):
            launch_weight_only_gemv(*_WORKER_INPUTS[key], **options)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # the timing process meets it again and records it
        return f"{type(exc).__name__}: {exc}"[:200]


def _precompile_all(pool, tasks: list[tuple]) -> None:
    if pool is None or not tasks:
        return
    start = time.monotonic()
    try:
        errors = sum(error is not None for error in pool.map(_precompile, tasks, chunksize=1))
    except Exception as exc:  # a worker died (BrokenProcessPool): the timing process compiles instead
        print(f"  compile workers failed ({type(exc).__name__}: {exc}); compiling while timing", flush=True)
        return
    print(f"  compiled {len(tasks)} settings in {time.monotonic() - start:.1f} s ({errors} failed)", flush=True)


def _start_pool(jobs: int):
    if jobs <= 0:
        return None
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    try:
        return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
    except (OSError, ValueError) as exc:
        print(f"  no compile workers ({exc}); compiling in this process", flush=True)
        return None


# --------------------------------------------------------------------------- the sweep


@dataclass
class Case:
    shape: Shape
    weight: str
    rows: int

    @property
    def name(self) -> str:
        return f"{self.shape.name}/{self.weight}/M{self.rows}"

    def task(self, setting: Setting | None) -> tuple:
        return (self.shape.name, self.shape.k, self.shape.n, self.weight, self.rows,
                setting.options() if setting is not None else {})


class CaseRun:
    """One case's inputs, reference output and measured rows."""

    def __init__(self, case: Case, seed: int, rep_ms: int):
        self.case = case
        self.rep_ms = rep_ms
        self.x, self.w_dense, self.w_q, self.w_scale, self.bias = make_inputs(case.shape, case.weight, case.rows, seed)
        self.weight_bytes = case.shape.n * case.shape.k * self.w_q.element_size()
        self.rows: list[dict] = []
        self.measured: set[Setting] = set()
        self.default_out = None
        self.bf16_us = None

    def _row(self, label: str, phase: str, setting: Setting | None, **fields) -> dict:
        row = dict(shape=self.case.shape.name, weight=self.case.weight, m=self.case.rows, setting=label,
                   phase=phase, options=setting.options() if setting is not None else {}, **fields)
        self.rows.append(row)
        return row

    def _timed(self, fn, weight_bytes: int) -> dict:
        us = harness.median_us(fn, warmup=5, rep=self.rep_ms)
        return dict(us=us, gbps=weight_bytes / us / 1e3, vs_bf16=self.bf16_us / us if self.bf16_us else None,
                    host_us=harness.host_us(fn))

    def baselines(self) -> None:
        import torch.nn.functional as F

        import omni_kernels.quant.gemm_ops  # noqa: F401  (registers the op)
        from omni_kernels.quant.triton_gemv import launch_weight_only_gemv

        bf16 = self._timed(lambda: F.linear(self.x, self.w_dense, self.bias), self.w_dense.numel() * self.w_dense.element_size())
        self.bf16_us = bf16["us"]
        bf16["vs_bf16"] = 1.0
        self._row("bf16 F.linear", "baseline", None, status="ok", **bf16)
        before = _compiled_kernels()
        self.default_out = self._launch(launch_weight_only_gemv, {})
        stats = self._new_kernel_stats(before)
        self._row("default", "default", None, status="ok", rel_l2_vs_default=0.0, **stats,
                  **self._timed(lambda: launch_weight_only_gemv(self.x, self.w_q, self.w_scale, self.bias),
                                self.weight_bytes))
        op = torch.ops.omni_kernels.weight_only_gemv_triton
        self._row("op (torch.ops)", "default", None,
                  **compare_with_default(op(self.x, self.w_q, self.w_scale, self.bias), self.default_out),
                  **self._timed(lambda: op(self.x, self.w_q, self.w_scale, self.bias), self.weight_bytes))

    def _launch(self, launch, options: dict) -> torch.Tensor:
        from torch._library.triton import set_wrap_triton_enabled

        with set_wrap_triton_enabled(False):
            out = launch(self.x, self.w_q, self.w_scale, self.bias, **options)
        harness.synchronize(torch.device(DEVICE))
        return out

    @staticmethod
    def _new_kernel_stats(before: dict) -> dict:
        new = [kernel for key, kernel in _compiled_kernels().items() if key not in before]
        return _kernel_stats(new[0]) if new else dict(regs=None, spills=None, smem=None)

    def measure(self, settings: list[Setting], phase: str) -> None:
        from omni_kernels.quant.triton_gemv import launch_weight_only_gemv

        for setting in settings:
            self.measured.add(setting)
            try:
                before = _compiled_kernels()
                out = self._launch(launch_weight_only_gemv, setting.options())
                stats = self._new_kernel_stats(before)
                check = compare_with_default(out, self.default_out)
                timing = self._timed(
                    lambda s=setting: launch_weight_only_gemv(self.x, self.w_q, self.w_scale, self.bias,
                                                              **s.options()), self.weight_bytes)
                self._row(setting.label, phase, setting, **stats, **check, **timing)
            except Exception as exc:  # a setting the compiler or the GPU rejects: record, go on
                self._row(setting.label, phase, setting, status=f"error: {type(exc).__name__}: {exc}"[:300])

    def ranked(self) -> list[Setting]:
        """Measured grid settings whose output agrees with the default's, fastest first."""
        good = [r for r in self.rows if r.get("us") and r["options"] and r["status"].startswith("ok")]
        good.sort(key=lambda r: r["us"])
        return [Setting(**r["options"]) for r in good]

    def pad_best(self) -> None:
        """``padded_us`` for the baseline, default, op and the best setting."""
        import torch.nn.functional as F

        from omni_kernels.quant.triton_gemv import launch_weight_only_gemv

        ranked = self.ranked()
        best_label = ranked[0].label if ranked else None
        op = torch.ops.omni_kernels.weight_only_gemv_triton
        calls = {
            "bf16 F.linear": lambda: F.linear(self.x, self.w_dense, self.bias),
            "default": lambda: launch_weight_only_gemv(self.x, self.w_q, self.w_scale, self.bias),
            "op (torch.ops)": lambda: op(self.x, self.w_q, self.w_scale, self.bias),
        }
        if best_label:
            calls[best_label] = lambda: launch_weight_only_gemv(self.x, self.w_q, self.w_scale, self.bias,
                                                                **ranked[0].options())
        for row in self.rows:
            if row["setting"] in calls and row.get("us"):
                row["padded_us"] = harness.padded_us(calls[row["setting"]], row.get("host_us") or 0.0)


def best_rows(rows: list[dict]) -> list[dict]:
    """Per (shape, weight, M): the fastest grid setting whose output agrees with the default's,
    with the case's bf16 and default rows."""
    out = []
    keys = list(dict.fromkeys((r["shape"], r["weight"], r["m"]) for r in rows))
    for key in keys:
        mine = [r for r in rows if (r["shape"], r["weight"], r["m"]) == key]
        good = [r for r in mine if r.get("us") and r["options"] and r["status"].startswith("ok")]
        out.append(dict(shape=key[0], weight=key[1], m=key[2],
                        bf16=next((r for r in mine if r["phase"] == "baseline"), None),
                        default=next((r for r in mine if r["setting"] == "default"), None),
                        op=next((r for r in mine if r["setting"] == "op (torch.ops)"), None),
                        best=min(good, key=lambda r: r["us"]) if good else None,
                        measured=sum(1 for r in mine if r["options"]),
                        failed=[r for r in mine if not r["status"].startswith("ok")]))
    return out


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def markdown(env: dict, rows: list[dict], flush_us: float | None, top: int = 8) -> str:
    lines = ["# Weight-only Triton GEMV: launch settings at Flux's adaLN modulation shapes", "",
             *harness.provenance_lines(env, f"triton {env['packages'].get('triton')}; x bf16 [M, K] with 4 outlier "
                                       "channels, bf16 bias"),
             "- median us of triton.testing.do_bench (L2 flushed), launched outside wrap_triton's tracing path; "
             "weight GB/s = weight bytes (8-bit; bf16 for the baseline) / median; vs bf16 = bf16 us / us; "
             f"host us = CPU time a call (L2 flush: {_fmt(flush_us, '.0f')} us of GPU time; above it the median "
             "includes idle GPU time); padded us = GPU time with a sleep covering the launch.",
             "- every setting's output is checked against the default's: `ok` rel L2 <= 1e-5, "
             "`ok (one rounding step)` one bf16 step apart in some values (K summed in another order).", "",
             "## Best setting per case", "",
             "| shape | weight | M | bf16 us | default us | op us | best setting | best us | padded us | weight GB/s "
             "| vs bf16 | vs default | regs/spills | settings |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for case in best_rows(rows):
        bf16, default, op, best = case["bf16"] or {}, case["default"] or {}, case["op"] or {}, case["best"]
        if best:
            vs_default = _fmt(default.get("us") / best["us"] if default.get("us") else None, ".2f")
            lines.append(
                f"| {case['shape']} | {case['weight']} | {case['m']} | {_fmt(bf16.get('us'), '.1f')} "
                f"| {_fmt(default.get('us'), '.1f')} | {_fmt(op.get('us'), '.1f')} | {best['setting']} "
                f"| {best['us']:.1f} | {_fmt(best.get('padded_us'), '.1f')} | {best['gbps']:.0f} "
                f"| {_fmt(best.get('vs_bf16'), '.2f')}x | {vs_default}x "
                f"| {_fmt(best.get('regs'), 'd')}/{_fmt(best.get('spills'), 'd')} | {case['measured']} |")
        else:
            lines.append(f"| {case['shape']} | {case['weight']} | {case['m']} | {_fmt(bf16.get('us'), '.1f')} "
                         f"| {_fmt(default.get('us'), '.1f')} | {_fmt(op.get('us'), '.1f')} | none agreed "
                         f"| - | - | - | - | - | - | {case['measured']} |")
    lines.append("")
    for case in best_rows(rows):
        mine = [r for r in rows if (r["shape"], r["weight"], r["m"]) == (case["shape"], case["weight"], case["m"])]
        fixed = [r for r in mine if not r["options"]]
        fastest = sorted((r for r in mine if r["options"] and r.get("us") and r["status"].startswith("ok")),
                         key=lambda r: r["us"])[:top]
        lines += [f"## {case['shape']}, {case['weight']}, M={case['m']}: the baselines and the {top} fastest", "",
                  "| setting | phase | median us | padded us | weight GB/s | vs bf16 | host us | regs | spills "
                  "| smem | rel L2 vs default | status |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in fixed + fastest + case["failed"]:
            if r.get("us") is None:
                lines.append(f"| {r['setting']} | {r['phase']} | - | - | - | - | - | - | - | - | - | {r['status']} |")
                continue
            lines.append(
                f"| {r['setting']} | {r['phase']} | {r['us']:.1f} | {_fmt(r.get('padded_us'), '.1f')} "
                f"| {r['gbps']:.0f} | {_fmt(r.get('vs_bf16'), '.2f')}x | {_fmt(r.get('host_us'), '.0f')} "
                f"| {_fmt(r.get('regs'), 'd')} | {_fmt(r.get('spills'), 'd')} | {_fmt(r.get('smem'), 'd')} "
                f"| {_fmt(r.get('rel_l2_vs_default'), '.1e')} | {r['status']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(DEFAULT_SHAPES))
    parser.add_argument("--weights", nargs="+", choices=sorted(WEIGHT_DTYPES), default=["int8", "fp8"])
    parser.add_argument("--rows", nargs="+", type=int, choices=range(1, FMA_MAX_ROWS + 1), default=list(DEFAULT_ROWS),
                        metavar="M", help="row counts (1 to 4; default: 1 2)")
    parser.add_argument("--coarse-cap", type=int, default=COARSE_CAP)
    parser.add_argument("--refine-top", type=int, default=REFINE_TOP)
    parser.add_argument("--refine-cap", type=int, default=REFINE_CAP)
    parser.add_argument("--rep-ms", type=int, default=25, help="do_bench's measuring time a setting (ms)")
    parser.add_argument("--jobs", type=int, default=max(0, min(12, (os.cpu_count() or 1) - 2)),
                        help="compile worker processes (0: compile while timing; default: CPUs - 2, at most 12)")
    parser.add_argument("--tag", default="", help="a name part for the output files")
    harness.add_out_dir_argument(parser, __file__)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if harness.refuse_without_gpu("bench/gemv_tune.py"):
        return 2
    start = time.monotonic()
    env = harness.base_environment(("triton",))
    sm_count = _sm_count()
    cases = [Case(SHAPES[s], w, m) for s in args.shapes for w in args.weights for m in args.rows]
    runs = [CaseRun(case, args.seed, args.rep_ms) for case in cases]
    pool = _start_pool(args.jobs)
    try:
        coarse = {run.case.name: coarse_grid(run.case.rows, run.case.shape, sm_count, args.coarse_cap) for run in runs}
        print(f"coarse: {sum(map(len, coarse.values()))} settings over {len(runs)} cases", flush=True)
        _precompile_all(pool, [run.case.task(None) for run in runs]
                        + [run.case.task(s) for run in runs for s in coarse[run.case.name]])
        for run in runs:
            run.baselines()
            run.measure(coarse[run.case.name], "coarse")
            print(f"  {run.case.name}: coarse done at {time.monotonic() - start:.0f} s", flush=True)
        refine = {run.case.name: refine_grid(run.ranked(), run.measured, run.case.rows, run.case.shape, sm_count,
                                             args.refine_top, args.refine_cap) for run in runs}
        print(f"refine: {sum(map(len, refine.values()))} settings", flush=True)
        _precompile_all(pool, [run.case.task(s) for run in runs for s in refine[run.case.name]])
    finally:
        if pool is not None:
            pool.shutdown()
    for run in runs:
        run.measure(refine[run.case.name], "refine")
        run.pad_best()
    flush_us = _flush_us()
    rows = [row for run in runs for row in run.rows]
    for case in best_rows(rows):
        best, bf16 = case["best"], case["bf16"] or {}
        print(f"best {case['shape']} {case['weight']} M={case['m']}: "
              + (f"{best['setting']} {best['us']:.1f} us ({best['gbps']:.0f} GB/s, "
                 f"{best.get('vs_bf16') or 0:.2f}x bf16's {bf16.get('us') or 0:.1f} us) options {best['options']}"
                 if best else "no setting agreed with the default"), flush=True)
    tag = f"-{args.tag}" if args.tag else ""
    grid = dict(coarse_plan=COARSE_PLAN, coarse_cap=args.coarse_cap, refine_top=args.refine_top,
                refine_cap=args.refine_cap, sm_count=sm_count, rep_ms=args.rep_ms, seed=args.seed)
    table = markdown(env, rows, flush_us)
    harness.write_results(args.out_dir, f"gemv_tune{tag}", env, dict(
        environment=env, grid=grid, flush_us=flush_us, elapsed_s=time.monotonic() - start,
        cases=[dict(shape=asdict(run.case.shape), weight=run.case.weight, m=run.case.rows) for run in runs],
        results=rows), table)
    print(table)
    print(f"elapsed {time.monotonic() - start:.0f} s")
    differs = [r for r in rows if r["status"].startswith("differs")]
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
