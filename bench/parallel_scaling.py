#!/usr/bin/env python3
"""Multi-GPU scaling of one transformer forward under omni's parallel strategies (torchrun).

One process per GPU (NCCL; gloo on CPU for ``--smoke``). Every rank builds the same
random-weight transformer of ``bench/pipeline.py`` (``flux``: FLUX.1-dev shape at 1024²;
``wan``: Wan2.1-14B shape at 480p/81 frames; ``--smoke``: their tiny CPU versions) and the
same inputs. Rank 0 first times the plain model on its own GPU (the 1-GPU baseline, same
process, same inputs, same attention backend) while the other ranks wait; then, for each
strategy, every rank applies it with ``omni_diffusion.accelerate(model,
AccelConfig(..., parallel=ParallelConfig(...)))``, the forward is timed on all ranks
together, and the strategy is undone before the next one:

* ``ulysses``: ``ParallelConfig(ulysses=N)``; ``ring``: ``ring=N``;
* ``usp``: ``ulysses=2, ring=N/2`` (N >= 4, even);
* ``tp``: ``tp=N`` (attention projections and MLPs sharded, one all-reduce per sub-block).

The acceleration stack is the same for the baseline and every strategy: omni's attention
(``--attention``), and with ``--compile`` regional ``torch.compile`` of the blocks, with
``--quant fp8|int8`` W8A8 linear layers, all through ``omni_diffusion.accelerate`` (with
``AccelConfig.parallel`` for the strategies), undone between runs. Without them the forwards
are eager, where a Flux-sized model is bound by each rank's kernel launches (every rank
still launches every kernel), so eager scaling understates what the stack reaches.

CFG parallelism splits the two guidance branches of a *pipeline* call, so it is not a
transformer-forward figure: measure it with a pipeline, not here.

Per strategy: the forward time (median over ``--iters`` after ``--warmup``, the slowest
rank's median), the speed-up and the scaling efficiency (speed-up / N) against rank 0's
plain forward, each rank's peak memory, and the relative error of rank 0's output against
its plain output. Rank 0 writes ``parallel_scaling_<model>_x<N>_<device>_<date>.json`` and
``.md`` to ``--out-dir`` and prints the table.

    torchrun --nproc_per_node 2 bench/parallel_scaling.py --model flux --out-dir bench/results
    torchrun --nproc_per_node 8 bench/parallel_scaling.py --model wan --compile --quant fp8
    torchrun --nproc_per_node 2 bench/parallel_scaling.py --smoke --model flux   # CPU check
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench._environment import base_environment, device_slug  # noqa: E402
from bench.pipeline import (  # noqa: E402
    MODELS,
    SMOKE_MODELS,
    build_transformer,
    make_inputs,
    relative_error,
    time_variant,
)

STRATEGIES = ("ulysses", "ring", "usp", "tp")


def parallel_config_for(strategy: str, world: int):
    """The ParallelConfig of ``strategy`` on ``world`` ranks, or None when it does not apply."""
    from omni_diffusion.parallel import ParallelConfig

    if strategy == "ulysses":
        return ParallelConfig(ulysses=world)
    if strategy == "ring":
        return ParallelConfig(ring=world)
    if strategy == "usp":
        return ParallelConfig(ulysses=2, ring=world // 2) if world >= 4 and world % 2 == 0 else None
    if strategy == "tp":
        return ParallelConfig(tp=world)
    raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}")


def _median_ms(model, inputs, warmup: int, iters: int, device: torch.device) -> tuple[float, torch.Tensor]:
    timing, out = time_variant(model, inputs, warmup, iters, device)
    return timing["forward_ms"], out


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _gather_floats(value: float | None, world: int) -> list[float | None]:
    values: list[float | None] = [None] * world
    dist.all_gather_object(values, value)
    return values


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="flux")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--attention", default="auto", help="omni attention backend for every run")
    parser.add_argument("--warmup", type=int, default=None, help="default: the model's (bench/pipeline.py)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="regional torch.compile of the blocks (every run)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend with --compile")
    parser.add_argument("--quant", choices=("fp8", "int8"), default=None, help="W8A8 linear layers (every run)")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU with gloo")
    parser.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT") or REPO_ROOT / "bench" / "results"))
    return parser.parse_args(argv)


def _stack_words(args) -> str:
    parts = [f"attention {args.attention}"]
    if args.compile:
        parts.append(f"regional compile ({args.compile_backend})")
    if args.quant:
        parts.append(f"{args.quant} W8A8 linears")
    return ", ".join(parts) if args.compile or args.quant else f"{parts[0]}, eager"


def _markdown(env: dict, spec, world: int, baseline_ms: float, rows: list[dict], stack: str) -> str:
    lines = [
        f"# Parallel scaling: {spec.name} on {world} x {env.get('device') or 'CPU (gloo)'}",
        "",
        f"commit {env.get('git_commit')}, torch {env.get('torch')}, {env.get('utc')}; "
        f"command: `{env.get('command')}`",
        "",
        f"{spec.description}. Stack (every run): {stack}. 1-GPU baseline (rank 0, plain forward, "
        f"same stack): {baseline_ms:.2f} ms.",
        "",
        "| strategy | config | forward ms (slowest rank) | speed-up | efficiency | peak GiB per rank | rel err | status |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['strategy']} | {r.get('config', '-')} | - | - | - | - | - | {r['status']} |")
            continue
        peaks = ", ".join("-" if p is None else f"{p:.1f}" for p in r["peak_gib"])
        lines.append(
            f"| {r['strategy']} | {r['config']} | {r['forward_ms']:.2f} | {r['speedup']:.2f}x | "
            f"{r['efficiency']:.0%} | {peaks} | {r['rel_err']:.1e} | ok |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun, e.g. torchrun --nproc_per_node 2 bench/parallel_scaling.py", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available() and not args.smoke
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = (SMOKE_MODELS if args.smoke else MODELS)[args.model]
    dtype = torch.bfloat16 if cuda else torch.float32
    warmup = spec.warmup if args.warmup is None else args.warmup
    iters = spec.iters if args.iters is None else args.iters

    import omni_diffusion as od
    model = build_transformer(spec, device, dtype)
    inputs = make_inputs(spec, device, dtype)
    stack = dict(attention=args.attention, compile=args.compile, compile_backend=args.compile_backend,
                 quant=args.quant)
    if args.quant and device.type == "cpu":  # the smoke test: torch's CPU ops, not the interpreter
        stack["quant_options"] = {"activation_backend": "torch"}
    baseline_ms, reference = 0.0, None
    if rank == 0:
        od.accelerate(model, od.AccelConfig(**stack))
        try:
            baseline_ms, reference = _median_ms(model, inputs, warmup, iters, device)
        finally:
            od.undo(model)
        print(f"[rank 0] plain forward {baseline_ms:.2f} ms", flush=True)
    dist.barrier()

    rows = []
    for strategy in args.strategies:
        config = parallel_config_for(strategy, world)
        if config is None:
            rows.append(dict(strategy=strategy, status=f"skipped: needs an even world size >= 4, got {world}"))
            continue
        described = ", ".join(f"{k}={v}" for k, v in vars(config).items() if isinstance(v, int) and v > 1)
        try:
            od.accelerate(model, od.AccelConfig(**stack, parallel=config))
        except ValueError as error:  # raised before any collective, the same on every rank
            rows.append(dict(strategy=strategy, config=described, status=f"refused: {error}"))
            continue
        try:
            _reset_peak(device)
            ms, out = _median_ms(model, inputs, warmup, iters, device)
            times = _gather_floats(ms, world)
            peaks = _gather_floats(_peak_gib(device), world)
        finally:
            od.undo(model)
            dist.barrier()
        if rank == 0:
            slowest = max(t for t in times if t is not None)
            rel = relative_error(out, reference)
            speedup = baseline_ms / slowest
            rows.append(dict(strategy=strategy, config=described, status="ok", forward_ms=round(slowest, 3),
                             rank_ms=times, speedup=round(speedup, 3), efficiency=round(speedup / world, 3),
                             peak_gib=peaks, rel_err=rel))
            print(f"[rank 0] {strategy} ({described}): {slowest:.2f} ms, {speedup:.2f}x, "
                  f"efficiency {speedup / world:.0%}, rel err {rel:.1e}", flush=True)

    if rank == 0:
        env = base_environment()
        date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d")
        slug = "cpu" if not cuda else device_slug(torch.cuda.get_device_name(device))
        tags = ("-smoke" if args.smoke else "") + ("-compile" if args.compile else "") + (f"-{args.quant}" if args.quant else "")
        stem = f"parallel_scaling_{spec.key}{tags}_x{world}_{slug}_{date}"
        args.out_dir.mkdir(parents=True, exist_ok=True)
        record = dict(benchmark="parallel_scaling", environment=env, model=spec.name, world_size=world,
                      baseline_ms=baseline_ms, rows=rows,
                      args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
        (args.out_dir / f"{stem}.json").write_text(json.dumps(record, indent=2))
        md = _markdown(env, spec, world, baseline_ms, rows, _stack_words(args))
        (args.out_dir / f"{stem}.md").write_text(md)
        print(md)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
