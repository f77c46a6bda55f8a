"""What every benchmark shares: where its record goes, what it records beside its numbers
(commit, device, versions, command), how it times a call, and how it writes the JSON + markdown."""

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
RESULTS = REPO_ROOT / "bench" / "results"

# Each script's topic: the folder of bench/results/ its records go to by default.
TOPICS = {
    "attention": "attention", "attention_profile": "attention", "attention_tune": "attention",
    "quantized_attention_tune": "quantized-attention", "sm90_kernel_alone": "quantized-attention-sm90",
    "linear": "linear", "gemv_tune": "gemv",
    "quant_per_token": "quant-activation", "quant_activation_tune": "quant-activation",
    "qk_norm_rope": "qk-norm-rope", "halo": "halo", "caching": "caching",
    "pipeline": "pipeline", "pipeline_profile": "pipeline-profile",
    "parallel_overhead": "parallel", "parallel_scaling": "parallel", "vae_parallel_scaling": "parallel",
    "prompt_encoding": "prompt-encoding", "serve": "serve",
}


def default_out_dir(script: str) -> Path:
    """Where ``script``'s record goes (``script``: its file name or stem, e.g. ``__file__``):
    ``$OUT`` when set, else ``bench/results/<topic>/``."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return RESULTS / TOPICS[Path(script).stem]


def add_out_dir_argument(parser, script: str, *flags: str) -> None:
    """``--out-dir`` (or ``flags``), a Path in ``args.out_dir``, on ``parser``, defaulting to
    :func:`default_out_dir` of ``script``."""
    parser.add_argument(*(flags or ("--out-dir",)), dest="out_dir", type=Path, default=default_out_dir(script),
                        help=f"where the .json and .md go (default: $OUT, else "
                             f"bench/results/{TOPICS[Path(script).stem]}/)")


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


def provenance_lines(env: dict, versions: str, *, arch: bool = False) -> list[str]:
    """A record's markdown bullets for ``env`` (:func:`base_environment`): device (with its arch
    when ``arch``), torch and CUDA, then ``versions`` (the rest, as the record words it); commit and
    time; the command."""
    device = f"{env['device']} ({env['arch']})" if arch else env["device"]
    return [f"- device: {device}; torch {env['torch']} (CUDA {env['cuda']}), {versions}",
            f"- git commit: {env['git_commit']}; {env['utc']}",
            f"- command: `{env['command']}`"]


def gpu_refusal(script: str) -> str | None:
    """Why benchmark ``script`` cannot time kernels here (no CUDA GPU, or Triton's interpreter
    on), or None."""
    if not torch.cuda.is_available():
        return f"{script} needs an NVIDIA GPU (torch.cuda.is_available() is False)"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "unset TRITON_INTERPRET: the benchmark must run compiled Triton kernels"
    return None


def refuse_without_gpu(script: str) -> bool:
    """True, with :func:`gpu_refusal`'s reason on stderr, when ``script`` cannot time kernels here."""
    refusal = gpu_refusal(script)
    if refusal:
        print(refusal, file=sys.stderr)
    return bool(refusal)


def device_slug(name: str, empty: str = "unknown-device") -> str:
    """A device name as a file-name part: ``"NVIDIA H200"`` -> ``"nvidia-h200"`` (``empty``
    when nothing is left)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or empty


def do_bench_us(fn, *, warmup: float = 25, rep: float = 200, return_mode: str = "median") -> float:
    """``triton.testing.do_bench`` of ``fn`` in microseconds (L2 flushed before each call;
    ``warmup`` and ``rep`` in ms), launched outside ``torch.library.wrap_triton``'s tracing
    path, as eager calls of omni's ops and Inductor's generated code launch their kernels
    (calling a wrapped launcher directly otherwise goes through a slow higher-order op)."""
    import triton
    from torch._library.triton import set_wrap_triton_enabled

    with set_wrap_triton_enabled(False):
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode=return_mode) * 1e3


def median_us(fn, *, warmup: float = 25, rep: float = 200) -> float:
    """:func:`do_bench_us`'s median."""
    return do_bench_us(fn, warmup=warmup, rep=rep)


def synchronize(device: torch.device | None = None) -> None:
    """Wait for ``device``'s queued work (the current GPU's when None; a no-op on the CPU)."""
    if device is None or device.type == "cuda":
        if torch.cuda.is_available():
            torch.cuda.synchronize(device)


def call_times_ms(fn, calls: int, device: torch.device | None = None) -> list[float]:
    """Time of each of ``calls`` calls of ``fn`` in ms, each waited for: CUDA events on a GPU
    (``device`` None: the current one), the host clock on the CPU."""
    cuda = device is None or device.type == "cuda"
    synchronize(device)
    times = []
    for _ in range(calls):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return times


def loop_ms(fn, calls: int, device: torch.device | None = None) -> float:
    """Time per call of ``calls`` back-to-back calls of ``fn`` in ms (each call's launches overlap
    the previous call's kernels, as in a denoising loop): CUDA events on a GPU, the host clock on
    the CPU."""
    cuda = device is None or device.type == "cuda"
    synchronize(device)
    started = time.perf_counter()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    for _ in range(calls):
        fn()
    if cuda:
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    return (time.perf_counter() - started) * 1e3 / calls


def wall_times_s(fn, calls: int, device: torch.device | None = None) -> tuple[list[float], object]:
    """Host wall time of each of ``calls`` calls of ``fn`` in seconds, the device synchronized
    before and after each (launch and host work included), and the last call's result. The
    previous result is dropped before each call, so the peak memory is one call's."""
    times, result = [], None
    for _ in range(calls):
        result = None
        synchronize(device)
        started = time.perf_counter()
        result = fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return times, result


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


def record_stem(name: str, device: str) -> str:
    """``{name}_{device}_{UTC date}``, the name bench/results_index.py reads; ``device`` is a
    device name (``"NVIDIA H200"`` -> ``nvidia-h200``), or ``"none"`` / ``"cpu"`` -> ``cpu``."""
    slug = "cpu" if device in ("", "none", "cpu") else device_slug(device)
    return f"{name}_{slug}_{_dt.datetime.now(_dt.timezone.utc):%Y%m%d}"


def write_record(out_dir: Path, stem: str, payload: dict, markdown: str | None, *, quiet: bool = False) -> Path:
    """``payload`` as ``out_dir/{stem}.json`` and ``markdown`` as the ``.md`` beside it (none when
    ``markdown`` is None); ``out_dir`` is created; says so on stderr unless ``quiet`` (a record
    rewritten after every row). Returns the path without suffix."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / stem
    (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    if markdown is not None:  # (a stem may hold dots: no with_suffix)
        (out_dir / f"{stem}.md").write_text(markdown.rstrip("\n") + "\n")
    if not quiet:
        print(f"wrote {path}.json" + ("" if markdown is None else " and .md"), file=sys.stderr)
    return path


def write_results(out_dir: Path, name: str, env: dict, payload: dict, table: str) -> Path:
    """:func:`write_record` as ``{name}_{env's device}_{UTC date}``."""
    return write_record(out_dir, record_stem(name, env["device"]), payload, table)


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
