"""Overhead of omni's sequence-parallel code path at degree 1 against plain execution.

One process, a world-size-1 process group (NCCL on a GPU, gloo on CPU): the
transformer runs once plainly and once with ``parallelize(...,
force_sequence_parallel=True)``, i.e. the whole Ulysses/Ring path (block hooks,
token split and gather, text/image split, the all-to-alls on a 1-rank group,
the ``omni_sp`` diffusers backend) with nothing actually split. Target: <= 2%.
Both runs use the same omni attention backend, so only the parallel path differs.

    python3 bench/parallel_overhead.py --out-dir bench/results   # prints one line per shape
    python3 bench/parallel_overhead.py --blocks 19 --single-blocks 38   # Flux.1's full depth

Model: a FluxTransformer2DModel with Flux.1's widths (24 heads x 128, 3072) and
``--blocks``/``--single-blocks`` blocks (random weights, bf16, initialized on
the GPU: the full 12B-parameter depth builds in seconds), at the token counts
of 1024x1024 (4096 image + 512 text) and 512x512 (1024 + 512).

Besides the times, each row counts the ops one forward dispatches (torch.profiler,
CPU side): data-moving ops (copy_, cat, stack, clone, contiguous) and
collectives, plain vs the sequence-parallel path. At degree 1 they should be
equal (tests/parallel/test_degree_one_overhead.py keeps that on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__:  # imported as bench.<script> (the tests)
    from bench import harness
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import harness



def _forward_times(fn, cuda: bool) -> tuple[float, float]:
    """(wall ms, host thread-CPU ms) of one ``fn()``, the GPU idle before and drained after."""
    if cuda:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    cpu = time.thread_time() - cpu
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - wall) * 1e3, cpu * 1e3


def _paired_times(run, install, pairs: int, warmup: int, cuda: bool) -> dict[str, list[float]]:
    """Per-forward wall and host-CPU times of plain and sequence-parallel forwards, in pairs.

    Each pair times one plain forward and one with ``install()``'s hooks in place, the order
    swapped every pair, so drift in clocks or in the host's load lands on both sides alike
    (medians of separate rounds swung by +-25% on the H200's host at launch-bound sizes).
    ``plain_b`` is a second plain forward in each pair: the plain-vs-plain spread is the
    noise floor the overhead is read against.
    """
    def side(parallel: bool) -> tuple[float, float]:
        undo = install() if parallel else None
        try:
            return _forward_times(run, cuda)
        finally:
            if undo is not None:
                undo()

    for _ in range(warmup):
        side(False), side(True)
    out: dict[str, list[float]] = {k: [] for k in ("plain", "sp", "plain_b", "plain_cpu", "sp_cpu")}
    for i in range(pairs):
        order = (False, True, False) if i % 2 == 0 else (True, False, False)
        seen_plain = False
        for parallel in order:
            wall, cpu = side(parallel)
            if parallel:
                out["sp"].append(wall)
                out["sp_cpu"].append(cpu)
            elif not seen_plain:
                out["plain"].append(wall)
                out["plain_cpu"].append(cpu)
                seen_plain = True
            else:
                out["plain_b"].append(wall)
    return out


def _host_profile(run, install, forwards: int = 10, top: int = 15) -> list[str]:
    """cProfile of ``forwards`` plain and sequence-parallel forwards: the Python functions
    whose own time grows most on the sequence-parallel path, per forward."""
    import cProfile
    import pstats

    def stats(parallel: bool) -> dict:
        undo = install() if parallel else None
        try:
            run()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(forwards):
                run()
            profiler.disable()
        finally:
            if undo is not None:
                undo()
        return pstats.Stats(profiler).stats

    plain, sp = stats(False), stats(True)
    rows = []
    for key in set(plain) | set(sp):
        calls = (sp.get(key, (0, 0))[1] - plain.get(key, (0, 0))[1]) / forwards
        own = (sp.get(key, (0, 0, 0))[2] - plain.get(key, (0, 0, 0))[2]) / forwards
        rows.append((own, calls, key))
    rows.sort(key=lambda r: r[0], reverse=True)
    return [f"{own * 1e3:+8.3f} ms {calls:+7.1f} calls  {Path(file).name}:{line} {name}"
            for own, calls, (file, line, name) in rows[:top]]


def _median_ratio_pct(a: list[float], b: list[float]) -> float:
    """Median over pairs of b/a - 1, in percent."""
    return 100 * (statistics.median(y / x for x, y in zip(a, b)) - 1)


#: ops whose count the rows report: data movement and collectives
COUNTED = ("aten::copy_", "aten::cat", "aten::stack", "aten::clone", "aten::contiguous")


def _op_counts(fn) -> dict[str, int]:
    """Data-moving ops and collectives one ``fn()`` dispatches, plus all aten ops."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = Counter(event.name for event in prof.events())
    counts = {name.split("::")[-1]: names.get(name, 0) for name in COUNTED}
    counts["collectives"] = sum(n for name, n in names.items()
                                if name.startswith(("c10d", "_c10d_functional", "nccl:", "gloo:")))
    counts["aten_ops"] = sum(n for name, n in names.items() if name.startswith("aten::"))
    return counts


def build_model(blocks: int, single_blocks: int, device: str, dtype: torch.dtype):
    """A random-weight Flux transformer built on ``device`` (no CPU init and copy: Flux.1's
    full depth has 12B parameters), then cast to ``dtype``."""
    from diffusers import FluxTransformer2DModel

    cuda = device == "cuda"
    heads, head_dim = (24, 128) if cuda else (4, 32)
    with torch.device(device):
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=blocks, num_single_layers=single_blocks,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=4096,
            pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56) if cuda else (8, 12, 12),
        )
    return model.to(dtype).eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--single-blocks", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=40,
                        help="timed (plain, sequence-parallel) forward pairs per shape, order alternated")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile-host", action="store_true",
                        help="also print the Python functions (cProfile) whose own time per forward "
                             "grows most on the sequence-parallel path")
    parser.add_argument("--attention", default="auto", help="omni attention backend for both runs")
    args = parser.parse_args()

    import torch.distributed as dist

    from omni_diffusion.parallel import ParallelConfig, parallelize

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    start = time.perf_counter()
    model = build_model(args.blocks, args.single_blocks, device, dtype)
    print(f"model: {args.blocks} + {args.single_blocks} blocks, "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters on {device}, "
          f"built in {time.perf_counter() - start:.1f} s", flush=True)
    import omni_diffusion as od

    od.accelerate(model, od.AccelConfig(attention=args.attention))
    shapes = [(4096, 512), (1024, 512)] if cuda else [(256, 32)]
    rows = []
    for image, text in shapes:
        gen = torch.Generator(device).manual_seed(1)
        inputs = dict(
            hidden_states=torch.randn(1, image, 64, device=device, dtype=dtype, generator=gen),
            encoder_hidden_states=torch.randn(1, text, 4096, device=device, dtype=dtype, generator=gen),
            pooled_projections=torch.randn(1, 768, device=device, dtype=dtype, generator=gen),
            timestep=torch.tensor([0.5], device=device, dtype=dtype),
            guidance=torch.tensor([3.5], device=device, dtype=dtype),
            img_ids=torch.randn(image, 3, device=device, generator=gen),
            txt_ids=torch.zeros(text, 3, device=device),
            return_dict=False,
        )

        def run():
            with torch.no_grad():
                return model(**inputs)[0]

        def parallel():
            return parallelize(model, ParallelConfig(), attention_backend=None if args.attention == "auto"
                               else args.attention, device_type=device, force_sequence_parallel=True)

        plain_out = run()
        plain_ops = _op_counts(run)
        undo = parallel()
        try:
            sp_out = run()
            sp_ops = _op_counts(run)
        finally:
            undo()
        t = _paired_times(run, parallel, args.pairs, args.warmup, cuda)
        p, s = statistics.median(t["plain"]), statistics.median(t["sp"])
        diff = (sp_out.float() - plain_out.float()).abs().max().item()
        row = dict(image_tokens=image, text_tokens=text, plain_ms=round(p, 3), sp_ms=round(s, 3),
                   overhead_pct=round(_median_ratio_pct(t["plain"], t["sp"]), 2),
                   noise_floor_pct=round(_median_ratio_pct(t["plain"], t["plain_b"]), 2),
                   plain_host_cpu_ms=round(statistics.median(t["plain_cpu"]), 3),
                   sp_host_cpu_ms=round(statistics.median(t["sp_cpu"]), 3),
                   host_cpu_overhead_pct=round(_median_ratio_pct(t["plain_cpu"], t["sp_cpu"]), 2),
                   max_abs_diff=diff, plain_ops=plain_ops, sp_ops=sp_ops)
        rows.append(row)
        if args.profile_host:
            print(f"host profile, image {image} + text {text} tokens (own time per forward, "
                  "sequence-parallel minus plain):")
            for line in _host_profile(run, parallel):
                print("  " + line, flush=True)
        extra = {name: (plain_ops[name], sp_ops[name]) for name in plain_ops
                 if plain_ops[name] != sp_ops[name]}
        print(f"image {image} + text {text} tokens: plain {p:.3f} ms, sequence-parallel path "
              f"{s:.3f} ms, overhead {row['overhead_pct']:+.2f}% (target <= 2%; plain vs plain "
              f"{row['noise_floor_pct']:+.2f}%), host CPU {row['plain_host_cpu_ms']:.2f} vs "
              f"{row['sp_host_cpu_ms']:.2f} ms ({row['host_cpu_overhead_pct']:+.2f}%), max |diff| {diff:.2e}; "
              f"ops per forward {plain_ops}, sequence-parallel path differs in "
              f"{extra or 'none'}", flush=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = dict(benchmark="parallel_overhead", environment=harness.base_environment(), rows=rows,
                  args=vars(args))
    (out_dir / "parallel_overhead.json").write_text(json.dumps(record, indent=2))
    env = record["environment"]
    lines = [
        f"# Sequence-parallel code path at degree 1 vs plain ({env.get('device', device)})", "",
        f"- commit {env.get('git_commit')}, torch {env.get('torch')} (CUDA {env.get('cuda')}, cuDNN "
        f"{env.get('cudnn')}), " + ", ".join(f"{k} {v}" for k, v in env.get("packages", {}).items())
        + f", python {env.get('python')}, {env.get('utc')}",
        f"- command: `python3 bench/parallel_overhead.py {' '.join(sys.argv[1:])}` (FluxTransformer2DModel, "
        f"{args.blocks} double + {args.single_blocks} single blocks, random {str(dtype).split('.')[-1]} weights, "
        f"one-rank {'NCCL' if cuda else 'gloo'} group, `force_sequence_parallel=True`; "
        f"{args.pairs} forward pairs, order alternated; overhead = median over pairs of sp/plain - 1; "
        "noise floor = the same for two plain forwards of each pair; host CPU = the Python thread's "
        "CPU time per forward)", "",
        "| tokens (image + text) | plain ms | sequence-parallel path ms | overhead | noise floor "
        "| host CPU ms plain / sp | max abs diff | ops equal |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['image_tokens']} + {r['text_tokens']} | {r['plain_ms']:.3f} | {r['sp_ms']:.3f} | "
                     f"{r['overhead_pct']:+.2f}% | {r['noise_floor_pct']:+.2f}% | {r['plain_host_cpu_ms']:.2f} / "
                     f"{r['sp_host_cpu_ms']:.2f} | {r['max_abs_diff']:.1e} | {r['plain_ops'] == r['sp_ops']} |")
    lines += ["", "Target (issue 7): overhead <= 2%."]
    (out_dir / "parallel_overhead.md").write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()
    worst = max(r["overhead_pct"] for r in rows)
    return 0 if not cuda or worst <= 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
