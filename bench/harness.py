"""What every benchmark records beside its numbers: commit, device, versions, command."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """HEAD (``-dirty`` when tracked files changed), or ``$OMNI_GIT_COMMIT``.

    A copy of the tree without ``.git`` (the GPU machine gets one) is told its commit through
    the environment variable; an explicit value always wins.
    """
    if os.environ.get("OMNI_GIT_COMMIT"):
        return os.environ["OMNI_GIT_COMMIT"]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
        if commit.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
            capture_output=True, text=True, timeout=10,
        )
        suffix = "-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else ""
        return commit.stdout.strip() + suffix
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_version(distribution: str) -> str:
    """The installed version of a distribution, or ``"not installed"``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def base_environment(packages: tuple[str, ...] = ("triton", "diffusers")) -> dict:
    """Commit, device, torch/CUDA/cuDNN/Python versions, ``packages``' versions, the command."""
    cuda = torch.cuda.is_available()
    capability = torch.cuda.get_device_capability() if cuda else None
    return dict(
        git_commit=git_commit(),
        device=torch.cuda.get_device_name() if cuda else "none",
        arch=f"sm{capability[0]}{capability[1]}" if capability else "cpu",
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if cuda else None,
        python=platform.python_version(),
        packages={name: package_version(name) for name in packages},
        command=" ".join([sys.executable, *sys.argv]),
        argv=sys.argv,
        utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def gpu_refusal(script: str) -> str | None:
    """Why benchmark ``script`` cannot time kernels here (no CUDA GPU, or Triton's interpreter
    on), or None."""
    if not torch.cuda.is_available():
        return f"{script} needs an NVIDIA GPU (torch.cuda.is_available() is False)"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "unset TRITON_INTERPRET: the benchmark must run compiled Triton kernels"
    return None


def device_slug(name: str, empty: str = "unknown-device") -> str:
    """A device name as a file-name part: ``"NVIDIA H200"`` -> ``"nvidia-h200"`` (``empty``
    when nothing is left)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or empty


def median_us(fn, *, warmup: int = 25, rep: int = 200) -> float:
    """``triton.testing.do_bench``'s median of ``fn`` in microseconds (L2 flushed before each
    call; ``warmup`` and ``rep`` in ms), launched outside ``torch.library.wrap_triton``'s tracing
    path, as eager calls of omni's ops and Inductor's generated code launch their kernels
    (calling a wrapped launcher directly otherwise goes through a slow higher-order op)."""
    import triton
    from torch._library.triton import set_wrap_triton_enabled

    with set_wrap_triton_enabled(False):
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def host_us(fn, calls: int = 20) -> float:
    """CPU time of one call of ``fn`` in microseconds (launches queued, not waited for), outside
    ``wrap_triton``'s tracing path as :func:`median_us`."""
    from torch._library.triton import set_wrap_triton_enabled

    with set_wrap_triton_enabled(False):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


def padded_us(fn, host_time_us: float, reps: int = 50) -> float | None:
    """Median GPU time of ``fn`` in microseconds with the L2 flushed and a GPU sleep before each
    call that outlasts its launch (``4 x host_time_us``, at least 100 us), so that no host time
    is counted, as it is in :func:`median_us` when a call's launches take longer than its
    kernels; None without ``torch.cuda._sleep``."""
    import triton
    from torch._library.triton import set_wrap_triton_enabled

    if not hasattr(torch.cuda, "_sleep"):
        return None
    clock_khz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 0) or 1_980_000
    pad_cycles = int(max(100.0, 4 * host_time_us) * clock_khz / 1000)
    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    with set_wrap_triton_enabled(False):
        fn()
        for start, end in events:
            cache.zero_()
            torch.cuda._sleep(pad_cycles)
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


def write_results(out_dir: Path, name: str, env: dict, payload: dict, table: str) -> Path:
    """Write ``payload`` as ``{name}_{device}_{UTC date}.json`` and ``table`` as the ``.md``
    beside it in ``out_dir`` (created); returns the path without suffix."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{name}_{device_slug(env['device'])}_{_dt.datetime.now(_dt.timezone.utc):%Y%m%d}"
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    stem.with_suffix(".md").write_text(table + "\n")
    return stem


def init_torchrun_process_group(cpu: bool, timeout: _dt.timedelta | None = None) -> torch.device:
    """Join torchrun's default process group; returns this process's device.

    ``cuda:$LOCAL_RANK`` with NCCL when a GPU is visible and ``cpu`` is false (made the current
    device), else the CPU with gloo. ``timeout``: the collectives' timeout (``None``: torch's).
    """
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not cpu
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    options = {} if timeout is None else dict(timeout=timeout)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None, **options)
    return device


def gather_from_ranks(value, world: int) -> list:
    """``value`` (any picklable: a time, a peak, None) from every rank of the default group, in rank order."""
    import torch.distributed as dist

    values: list = [None] * world
    dist.all_gather_object(values, value)
    return values
