"""Caching on the trained embedded models: speed-up against the drop in quality.

``--kind image`` (default): the embedded digits FluxPipeline (:mod:`omni_diffusion.embedded`,
32x32, 28 steps by default) draws ``--n`` images, the digits 0..9 in turn, image ``i`` from its
own generator seeded ``--seed + i``, one image per call. ``--kind video``: the embedded
WanPipeline (9 frames of 32x32, 50 steps, CFG 5 by default) makes ``--n`` clips of the
digit-direction pairs of :func:`~omni_diffusion.embedded.evaluate_video.video_targets`, clip
``i`` seeded ``--seed + i``, one clip per call; adherence there needs the digit and the
direction right, and PSNR/SSIM are over all frames. Each is measured:

* first without caching (``reference``);
* then, for each threshold, under ``omni_diffusion.accelerate(pipe, AccelConfig(attention=None,
  cache=CacheConfig(kind, threshold=t)))`` and ``omni_diffusion.undo(pipe)`` afterwards.
  ``attention=None`` leaves attention as diffusers has it, so only caching differs from the
  reference.

Per row: median CPU time of the process per image (three warm-up calls first, not counted;
the median wall time beside it), speed-up against the reference's median CPU time, the fraction of transformer passes that skipped blocks (``hit_rate``)
and of block calls skipped (``blocks_skipped``; First-Block-Cache always runs the first
block), from ``omni_diffusion.last_cache_stats``; adherence (fraction the digit classifier of
:mod:`omni_diffusion.embedded.evaluate` reads as the prompted digit); PSNR over all pixels and
mean SSIM against the reference image of the same seed (images in [0, 1]).

Timing is on the CPU with ``torch.set_num_threads(--threads)`` (default 1, for stable
numbers on a shared machine). The speed-up is read from the process's CPU time, which other
processes on the machine barely move (a run whose reference overlapped a test run read 1.67x
from wall times where 24% of the blocks were skipped); the load average is recorded beside each row. Results go to
``--out-dir`` (default ``$OUT`` or bench/results/) as ``caching_cpu_<YYYYMMDD>.{json,md}``
(``caching-video_cpu_...`` for video).

    .venv/bin/python bench/caching.py
    .venv/bin/python bench/caching.py --kind video --n 40
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
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


DEFAULT_THRESHOLDS = {"first_block": [0.05, 0.1, 0.2], "teacache": [0.1, 0.25, 0.5]}


def parse_args(argv=None) -> argparse.Namespace:
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else harness.REPO_ROOT / "bench" / "results"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("image", "video"), default="image", help="which embedded model")
    parser.add_argument("--n", type=int, default=100, help="images (clips) per configuration (digits 0..9 in turn)")
    parser.add_argument("--seed", type=int, default=0, help="image i is drawn with seed + i")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the pipeline's)")
    parser.add_argument("--first-block", type=float, nargs="*", default=DEFAULT_THRESHOLDS["first_block"],
                        help="First-Block-Cache thresholds")
    parser.add_argument("--teacache", type=float, nargs="*", default=DEFAULT_THRESHOLDS["teacache"],
                        help="TeaCache thresholds")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--out-dir", type=Path, default=default_out)
    args = parser.parse_args(argv)
    for name in ("n", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: {getattr(args, name)} is not allowed; allowed: >= 1")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps: {args.steps} is not allowed; allowed: >= 1")
    for name in ("first_block", "teacache"):
        for t in getattr(args, name):
            if not math.isfinite(t) or t < 0:
                raise ValueError(f"--{name.replace('_', '-')}: {t} is not allowed; allowed: finite numbers >= 0")
    return args


class _Image:
    """The image model's targets, generation and scoring."""

    def __init__(self, n: int):
        self.targets = [i % 10 for i in range(n)]

    @staticmethod
    def draw(pipe, target, steps, seed) -> torch.Tensor:
        from omni_diffusion.embedded.evaluate import generate_digits

        return generate_digits(pipe, [target], steps=steps, seed=seed)  # (1, 3, 32, 32) in [0, 1]

    def adherence(self, outputs: torch.Tensor) -> float:
        from omni_diffusion.embedded.evaluate import adherence

        return adherence(outputs, self.targets)

    @staticmethod
    def as_images(outputs: torch.Tensor) -> torch.Tensor:
        return outputs


class _Video:
    """The video model's targets (digit, direction), generation and scoring."""

    def __init__(self, n: int):
        from omni_diffusion.embedded.evaluate_video import video_targets

        digits, directions = video_targets(n)
        self.targets = list(zip(digits, directions))

    @staticmethod
    def draw(pipe, target, steps, seed) -> torch.Tensor:
        from omni_diffusion.embedded.evaluate_video import generate_videos

        return generate_videos(pipe, [target[0]], [target[1]], steps=steps, seed=seed)  # (1, T, H, W) in [-1, 1]

    def adherence(self, outputs: torch.Tensor) -> float:
        from omni_diffusion.embedded.evaluate_video import video_adherence

        digits, directions = zip(*self.targets)
        return video_adherence(outputs, list(digits), list(directions))

    @staticmethod
    def as_images(outputs: torch.Tensor) -> torch.Tensor:
        """Clips ``(N, T, H, W)`` in [-1, 1] -> frames ``(N * T, 1, H, W)`` in [0, 1]."""
        return ((outputs.flatten(0, 1)[:, None] + 1) / 2).clamp(0, 1)


def generate(pipe, kind, seed: int, steps: int | None, stats_of=None):
    """The outputs of ``kind``'s targets, one call each (seed ``seed + i``), concatenated, the
    wall seconds of each call, and ``stats_of(pipe)`` after each call (cache stats) when given."""
    for _ in range(3):  # warm-up (first calls allocate and fill caches), not counted
        kind.draw(pipe, kind.targets[0], steps, seed)
    outputs, seconds, stats = [], [], []
    for i, target in enumerate(kind.targets):
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs.append(kind.draw(pipe, target, steps, seed + i))
        seconds.append((time.perf_counter() - start, time.process_time() - cpu_start))
        if stats_of is not None:
            stats.append(stats_of(pipe))
    return torch.cat(outputs), seconds, stats


def measure(pipe, kind, args, reference=None, cache=None) -> tuple[dict, torch.Tensor]:
    """One row: ``cache`` None (the reference) or a :class:`omni_diffusion.CacheConfig`."""
    import omni_diffusion as od
    from omni_diffusion.embedded.evaluate import psnr, ssim

    load_before = os.getloadavg()[0]
    if cache is None:
        outputs, seconds, _ = generate(pipe, kind, args.seed, args.steps)
        stats = []
    else:
        od.accelerate(pipe, od.AccelConfig(attention=None, cache=cache))
        try:
            outputs, seconds, stats = generate(pipe, kind, args.seed, args.steps, od.last_cache_stats)
        finally:
            od.undo(pipe)
    row = dict(
        config="reference" if cache is None else cache.kind,
        threshold=None if cache is None else cache.threshold,
        images=len(kind.targets),
        # the process's CPU time: with one torch thread it is the work itself, and other
        # processes on a shared machine (which inflate the wall time) barely move it
        ms_per_image=1e3 * statistics.median(cpu for _, cpu in seconds),
        ms_per_image_mean=1e3 * statistics.fmean(cpu for _, cpu in seconds),
        wall_ms_per_image=1e3 * statistics.median(wall for wall, _ in seconds),
        adherence=kind.adherence(outputs),
        load_average=[load_before, os.getloadavg()[0]],
    )
    if stats:
        passes = sum(s.passes for s in stats)
        blocks = sum(s.blocks_total for s in stats)
        row.update(passes=passes, hit_rate=sum(s.hits for s in stats) / passes,
                   blocks_skipped=sum(s.blocks_skipped for s in stats) / blocks)
    else:
        row.update(passes=None, hit_rate=0.0, blocks_skipped=0.0)
    if reference is not None:
        images, reference_images = kind.as_images(outputs), kind.as_images(reference)
        value = psnr(images, reference_images, data_range=1.0)
        row.update(psnr_db=None if math.isinf(value) else value,  # JSON has no inf: null = identical
                   ssim=ssim(images, reference_images, data_range=1.0),
                   max_abs_diff=float((images - reference_images).abs().max()),
                   identical=bool(torch.equal(outputs, reference)))
    return row, outputs


def markdown(data: dict) -> str:
    env = data["environment"]
    video = env.get("kind") == "video"
    what = "clip" if video else "image"
    lines = [
        f"# Caching on the embedded {env.get('kind', 'image')} model (CPU, torch threads: {env['threads']})",
        "",
        (f"{env['images']} clips (digit-direction pairs in turn, seeds {env['seed']}..{env['seed'] + env['images'] - 1}), "
         f"{env['steps']} steps, CFG on, 9 frames of 32x32; adherence = digit and direction both right"
         if video else
         f"{env['images']} images (digits 0..9 in turn, seeds {env['seed']}..{env['seed'] + env['images'] - 1}), "
         f"{env['steps']} steps, 32x32")
        + f"; median CPU time of the process per {what} (speed-up from it; wall time beside it); PSNR/SSIM against the uncached {what} of the same seed"
        + (" (over all frames)" if video else "")
        + "; skipped passes = transformer passes that skipped blocks, skipped blocks = "
        "block calls skipped (First-Block-Cache always runs the first block).",
        "",
        f"| cache | threshold | CPU ms/{what} | speed-up | wall ms/{what} | skipped passes | skipped blocks | "
        "adherence | PSNR dB | SSIM |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        if "ssim" in r:
            psnr_text = "inf (identical)" if r["psnr_db"] is None else f"{r['psnr_db']:.2f}"
            quality = f"{psnr_text} | {r['ssim']:.4f}"
        else:
            quality = " | "
        threshold = "" if r["threshold"] is None else f"{r['threshold']:g}"
        lines.append(f"| {r['config']} | {threshold} | {r['ms_per_image']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['wall_ms_per_image']:.1f} | "
                     f"{r['hit_rate']:.1%} | {r['blocks_skipped']:.1%} | {r['adherence']:.2f} | {quality} |")
    lines += ["", f"commit {env['git_commit']}; torch {env['torch']}, diffusers {env['packages']['diffusers']}; "
              f"load average (1 min, 2 shared cores) {env['load_average_range'][0]:.2f}..."
              f"{env['load_average_range'][1]:.2f}", "", f"command: `{env['command']}`", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parse_args(argv)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, argv)
    finally:  # main() may run inside another process (a test); leave its thread count as it was
        torch.set_num_threads(threads_before)


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    import omni_diffusion as od
    from omni_diffusion.embedded import load_embedded_pipeline

    pipe = load_embedded_pipeline(args.kind)
    steps = args.steps
    if steps is None:
        import inspect

        steps = inspect.signature(pipe.__call__).parameters["num_inference_steps"].default
    kind = (_Video if args.kind == "video" else _Image)(args.n)
    reference_row, reference = measure(pipe, kind, args)
    rows = [reference_row]
    configs = [od.CacheConfig("first_block", threshold=t) for t in args.first_block]
    configs += [od.CacheConfig("teacache", threshold=t) for t in args.teacache]
    for cache in configs:
        row, _ = measure(pipe, kind, args, reference, cache)
        rows.append(row)
        print(f"{row['config']} {row['threshold']:g}: {row['ms_per_image']:.1f} ms, "
              f"skipped {row['hit_rate']:.1%}, adherence {row['adherence']:.2f}, "
              f"PSNR {row['psnr_db'] or math.inf:.2f} dB",
              flush=True)
    for row in rows:
        row["speedup"] = reference_row["ms_per_image"] / row["ms_per_image"]
    loads = [x for r in rows for x in r["load_average"]]
    environment = dict(harness.base_environment(("diffusers", "transformers", "scikit-learn")),
                       threads=args.threads, images=args.n, seed=args.seed, steps=steps,
                       load_average_range=[min(loads), max(loads)], kind=args.kind,
                       model=("embedded video (digits WanPipeline)" if args.kind == "video"
                              else "embedded image (digits FluxPipeline)"))
    # the arguments main() was given (a test calls it directly, where sys.argv is pytest's)
    environment.update(command=" ".join([sys.executable, "bench/caching.py", *argv]),
                       argv=["bench/caching.py", *argv])
    data = dict(environment=environment, results=rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "caching" if args.kind == "image" else "caching-video"
    stem = args.out_dir / f"{name}_cpu_{_dt.date.today():%Y%m%d}"
    stem.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    text = markdown(data)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
