#!/usr/bin/env python3
"""Multi-GPU scaling of a VAE decode under omni's VAE parallelism, tile vs spatial (torchrun).

One process per GPU (NCCL; gloo on CPU for ``--smoke``). ``--model`` names one or more VAEs
(default both), each built on every rank with the same random weights and seeded latent:
``wan``, ``AutoencoderKLWan`` with Wan2.1's config decoding 720p x 81 frames (latent
``[1, 16, 21, 90, 160]``; ``--frames`` shortens it), and ``flux``, ``AutoencoderKL`` with
FLUX.1's config decoding 2048x2048 (latent ``[1, 16, 256, 256]``), both bf16 with diffusers'
own tile sizes; ``--smoke``: tiny float32 versions of both on the CPU (seconds).

Rank 0 first decodes alone while the other ranks wait: untiled (the baseline of spatial mode,
whose output equals it) and diffusers' tiled decode (the baseline of tile mode). Then each mode
is applied on every rank with ``parallelize_vae(vae, world_group, mode, ...)``, timed on all
ranks together, and undone with ``unparallelize_vae``: ``tile`` spreads diffusers' tiles over
the ranks; ``spatial`` splits the feature map along its height through the whole decoder (halo
exchange at the convolutions, all-reduced GroupNorm statistics) and gathers the rows at the end.

Per run: the decode time (median over ``--iters`` after ``--warmup``, a mode's slowest rank),
the speed-up over the matching baseline, each rank's peak memory (on the GPU
``torch.cuda.max_memory_allocated``; on the CPU the bytes counted by
:class:`omni_diffusion.vae_parallel.PeakMemoryTracker` during one extra decode), the largest
rank's peak as a fraction of the baseline's, and the relative L2 error of rank 0's output
against the baseline's (and the untiled one). Target (issue 11): Wan 720p decode >= 3x faster
with <= 40% of the 1-GPU peak memory per GPU at 4 GPUs in spatial mode.

Record (rank 0, per model): ``vae_parallel_scaling_<model>[-smoke]_x<N>_<device>_<date>.json``
and ``.md`` in ``--out-dir`` (default ``$OUT``, else ``bench/results/parallel/``); the table is
printed. Keep NVLink multicast off on shared hosts, as ``scripts/device_gpu.sh`` does::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --nproc_per_node 4 bench/vae_parallel_scaling.py --model wan
    torchrun --nproc_per_node 2 bench/vae_parallel_scaling.py --smoke   # CPU check, both VAEs
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import os
import statistics
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

if __package__:  # imported as bench.<script> (the tests)
    from bench import harness, pipeline
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import harness
    import pipeline


MODES = ("tile", "spatial")
# A whole Wan 720p baseline (untiled + tiled, warm-up + timed decodes) keeps the other ranks
# waiting for minutes: longer than NCCL's default 10-minute collective timeout allows for.
PROCESS_GROUP_TIMEOUT = _dt.timedelta(minutes=60)


@dataclasses.dataclass(frozen=True)
class VaeCase:
    """One VAE to decode with: how to build it (float32, CPU, random weights, ``seed`` 0) and
    its latent. ``latent_shape`` is ``[B, C, H, W]`` or ``[B, C, T, H, W]``; for a video VAE
    ``temporal_factor`` maps ``--frames`` (4k+1) to ``T``."""

    key: str
    name: str
    description: str
    build: Callable[[], torch.nn.Module]
    latent_shape: tuple[int, ...]
    temporal_factor: int | None = None
    # vae.enable_tiling(**tile_kwargs) sets the tile sizes (empty: diffusers' defaults)
    tile_kwargs: dict = dataclasses.field(default_factory=dict)
    # (ranks, min speed-up, max peak fraction) of the spatial-mode target, when there is one
    spatial_target: tuple[int, float, float] | None = None

    def latent(self, frames: int | None) -> tuple[int, ...]:
        """The latent shape; ``frames`` (``None``: the default) sets a video latent's ``T`` and
        is ignored for an image VAE."""
        if frames is None or self.temporal_factor is None:
            return self.latent_shape
        if frames < 1 or (frames - 1) % self.temporal_factor:
            raise ValueError(f"--frames must be {self.temporal_factor}k+1 for {self.key}; got {frames}")
        b, c, _, h, w = self.latent_shape
        return (b, c, (frames - 1) // self.temporal_factor + 1, h, w)


def _wan21_vae():
    from diffusers import AutoencoderKLWan

    # Wan2.1's VAE config (diffusers' defaults, as in bench/halo.py).
    return AutoencoderKLWan(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                            temperal_downsample=[False, True, True])


def _flux1_vae():
    from diffusers import AutoencoderKL

    # FLUX.1's VAE config (black-forest-labs/FLUX.1-dev, vae/config.json).
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
        layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    )


def _tiny_wan_vae():
    from diffusers import AutoencoderKLWan

    # Wan's causal-conv structure with 4x spatial / 2x temporal up-sampling and tiny widths.
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, True], latents_mean=[0.0] * 4,
                            latents_std=[1.0] * 4, scale_factor_temporal=2, scale_factor_spatial=4)


def _tiny_flux_vae():
    from diffusers import AutoencoderKL

    # 4x up-sampling, a mid-block attention; sample_size 64 makes the tiles 16 latent rows
    # (stride 12): a 24x24 latent is 2x2 tiles.
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 16, 16),
        layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=64,
        use_quant_conv=False, use_post_quant_conv=False,
    )


CASES = {
    "wan": VaeCase("wan", "Wan2.1 VAE, 720p x 81 frames",
                   "AutoencoderKLWan (Wan2.1 config, random weights), 720x1280 output",
                   _wan21_vae, (1, 16, 21, 90, 160), temporal_factor=4, spatial_target=(4, 3.0, 0.4)),
    "flux": VaeCase("flux", "FLUX.1 VAE, 2048x2048",
                    "AutoencoderKL (FLUX.1 config, random weights), 2048x2048 output",
                    _flux1_vae, (1, 16, 256, 256)),
}
SMOKE_CASES = {
    "wan": VaeCase("wan", "tiny Wan-like VAE (smoke)",
                   "AutoencoderKLWan, widths 8-16, 4x spatial / 2x temporal",
                   _tiny_wan_vae, (1, 4, 2, 16, 16), temporal_factor=2,
                   # tiles of 10 latent rows, stride 8: a 16x16 latent is 2x2 tiles
                   tile_kwargs=dict(tile_sample_min_height=40, tile_sample_min_width=40,
                                    tile_sample_stride_height=32, tile_sample_stride_width=32)),
    "flux": VaeCase("flux", "tiny Flux-like VAE (smoke)",
                    "AutoencoderKL, widths 8-16, 4x spatial, 4 latent channels",
                    _tiny_flux_vae, (1, 4, 24, 24)),
}


def build_vae(case: VaeCase, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``case``'s VAE on ``device`` in ``dtype``, the same random weights on every rank, its
    tile sizes set and tiling off."""
    torch.manual_seed(0)
    vae = case.build().to(device, dtype).eval()
    vae.enable_tiling(**case.tile_kwargs)
    vae.disable_tiling()
    return vae


def make_latent(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A standard-normal latent of ``shape``, identical on every rank (a seeded CPU generator)."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(shape, generator=generator).to(device, dtype)


def _decode(vae, z: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return vae.decode(z).sample


def time_decode(vae, z: torch.Tensor, warmup: int, iters: int,
                device: torch.device) -> tuple[float, int, torch.Tensor]:
    """Median decode ms over ``iters`` after ``warmup`` decodes, this process's peak memory in
    bytes (see the module docstring), and the last output."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    seconds, out = harness.wall_times_s(lambda: _decode(vae, z), warmup + iters, device)
    times = [s * 1e3 for s in seconds[warmup:]]
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        from omni_diffusion.vae_parallel import PeakMemoryTracker

        out = None
        # Counted on an extra, untimed decode: the tracker's per-op bookkeeping costs time.
        with warnings.catch_warnings(), PeakMemoryTracker() as tracker:
            # Tile mode traces other ranks' tiles on FakeTensors, whose storages all report
            # data_ptr 0: the tracker counts at most one of them at a time; torch warns on each.
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            out = _decode(vae, z)
        peak = tracker.peak_bytes
    return statistics.median(times), peak, out


def _baseline(label: str, vae, z, tiled: bool, warmup: int, iters: int,
              device) -> tuple[dict, torch.Tensor | None]:
    """Rank 0's plain decode (tiling on or off) as a row, and its output on the CPU."""
    name = "tiled" if tiled else "untiled"
    vae.use_tiling = tiled
    try:
        ms, peak, out = time_decode(vae, z, warmup, iters, device)
    except Exception as error:  # only rank 0 runs this; the others wait at a barrier
        traceback.print_exc()
        return dict(run=f"1-GPU {name}", ranks=1, status=f"error: {type(error).__name__}: {error}"[:300]), None
    finally:
        vae.use_tiling = False
    print(f"[rank 0] {label} 1-GPU {name} decode: {ms:.2f} ms, peak {peak / 2**30:.3f} GiB", flush=True)
    return dict(run=f"1-GPU {name}", ranks=1, status="ok", decode_ms=round(ms, 3),
                peak_bytes=[peak]), out.cpu()


def _error_against(out: torch.Tensor, reference: torch.Tensor | None) -> float | None:
    return None if reference is None else pipeline.relative_error(out, reference.to(out.device))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=sorted(CASES), default=["wan", "flux"],
                        help="one or more VAEs, decoded one after the other (a file pair each)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--frames", type=int, default=None,
                        help="video frames of the video VAEs (wan: 4k+1, default 81); image VAEs ignore it")
    parser.add_argument("--warmup", type=int, default=1, help="untimed decodes before the timed ones")
    parser.add_argument("--iters", type=int, default=3, help="timed decodes (the median is reported)")
    parser.add_argument("--halo-backend", default="auto", help="parallelize_vae's halo_backend")
    parser.add_argument("--gather-to-rank0", action="store_true",
                        help="spatial output gathered to rank 0 only (output_rank=0); default: every rank, "
                             "as omni's pipelines do")
    parser.add_argument("--smoke", action="store_true", help="tiny VAEs on CPU with gloo")
    harness.add_out_dir_argument(parser, __file__)
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.iters < 1:
        parser.error(f"--warmup must be >= 0 and --iters >= 1; got {args.warmup}, {args.iters}")
    from omni_kernels.halo import HALO_BACKENDS

    if args.halo_backend not in HALO_BACKENDS:
        parser.error(f"--halo-backend must be one of {HALO_BACKENDS}; got {args.halo_backend!r}")
    try:
        for key in args.model:
            (SMOKE_CASES if args.smoke else CASES)[key].latent(args.frames)
    except ValueError as error:
        parser.error(str(error))
    return args


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _target_line(case: VaeCase, world: int, rows: list[dict]) -> list[str]:
    if case.spatial_target is None:
        return []
    ranks, speedup, fraction = case.spatial_target
    line = f"Target (issue 11): spatial at {ranks} GPUs >= {speedup:g}x and <= {fraction:.0%} of the 1-GPU peak per GPU"
    spatial = next((r for r in rows if r["run"] == f"spatial x{world}" and r["status"] == "ok"), None)
    if world != ranks or spatial is None or spatial.get("speedup") is None:
        return [line + f": not measured here ({world} ranks).", ""]
    met = spatial["speedup"] >= speedup and spatial["peak_fraction"] <= fraction
    return [line + f": {spatial['speedup']:.2f}x, {spatial['peak_fraction']:.0%}: "
                   f"{'met' if met else 'not met'}.", ""]


def _markdown(env: dict, case: VaeCase, latent: tuple[int, ...], world: int, rows: list[dict],
              args, dtype: torch.dtype) -> str:
    lines = [
        f"# VAE decode scaling: {case.name} on {world} x {env.get('device') if env.get('device') != 'none' else 'CPU (gloo)'}",
        "",
        f"commit {env.get('git_commit')}, torch {env.get('torch')}, diffusers "
        f"{env.get('packages', {}).get('diffusers')}, {env.get('utc')}; command: `{env.get('command')}`",
        "",
        f"{case.description}; latent {list(latent)}, {str(dtype).replace('torch.', '')}, halo backend "
        f"{args.halo_backend}, spatial output gathered to {'rank 0' if args.gather_to_rank0 else 'every rank'}; "
        f"median of {args.iters} decodes after {args.warmup} warm-up. Speed-up, peak fraction and rel err "
        "are against the matching 1-GPU baseline (tile: the tiled decode; spatial: the untiled one); "
        "rel err vs untiled is always against the untiled decode.",
        "",
        *_target_line(case, world, rows),
        "| run | baseline | decode ms (slowest rank) | speed-up | peak per rank | peak / baseline "
        "| rel err | rel err vs untiled | status |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | --- |",
    ]

    def fmt(value, spec, suffix=""):
        return "-" if value is None else format(value, spec) + suffix

    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['run']} | {r.get('baseline', '-')} | - | - | - | - | - | - | {r['status']} |")
            continue
        peaks = ", ".join(_size(p) for p in r["peak_bytes"])
        lines.append(
            f"| {r['run']} | {r.get('baseline', '-')} | {r['decode_ms']:.2f} | {fmt(r.get('speedup'), '.2f', 'x')} | "
            f"{peaks} | {fmt(r.get('peak_fraction'), '.0%')} | {fmt(r.get('rel_err'), '.1e')} | "
            f"{fmt(r.get('rel_err_vs_untiled'), '.1e')} | ok |")
    return "\n".join(lines) + "\n"


def run_case(case: VaeCase, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Every rank: build ``case``'s VAE, rank 0's two baselines, then each mode on all ranks.
    Returns the rows on rank 0 (the other ranks: an empty list)."""
    from omni_diffusion.vae_parallel import parallelize_vae, unparallelize_vae

    rank, world = dist.get_rank(), dist.get_world_size()
    vae = build_vae(case, device, dtype)
    z = make_latent(case.latent(args.frames), device, dtype)
    rows: list[dict] = []
    baselines: dict[str, dict] = {}
    references: dict[str, torch.Tensor | None] = {}
    if rank == 0:
        for name in ("untiled", "tiled"):
            row, references[name] = _baseline(case.key, vae, z, name == "tiled", args.warmup, args.iters, device)
            baselines[name] = row
            rows.append(row)
        untiled, tiled = baselines["untiled"], baselines["tiled"]
        if tiled["status"] == "ok":
            tiled.update(baseline="1-GPU untiled")
            if untiled["status"] == "ok":
                tiled.update(speedup=round(untiled["decode_ms"] / tiled["decode_ms"], 3),
                             peak_fraction=round(tiled["peak_bytes"][0] / untiled["peak_bytes"][0], 4))
            if references["untiled"] is not None:
                tiled["rel_err"] = tiled["rel_err_vs_untiled"] = pipeline.relative_error(references["tiled"],
                                                                                references["untiled"])
    dist.barrier()

    output_rank = 0 if args.gather_to_rank0 else None
    for mode in args.modes:
        run = f"{mode} x{world}"
        baseline_name = "tiled" if mode == "tile" else "untiled"
        try:
            parallelize_vae(vae, dist.group.WORLD, mode, output_rank=output_rank,
                            halo_backend=args.halo_backend)
        except ValueError as error:  # raised before any collective, the same on every rank
            rows.append(dict(run=run, ranks=world, status=f"refused: {error}"))
            continue
        try:
            ms, peak, out = time_decode(vae, z, args.warmup, args.iters, device)
            times = harness.gather_from_ranks(ms, world)
            peaks = harness.gather_from_ranks(peak, world)
        finally:
            unparallelize_vae(vae)
            dist.barrier()
        if rank == 0:
            slowest = max(times)
            row = dict(run=run, ranks=world, mode=mode, baseline=f"1-GPU {baseline_name}", status="ok",
                       decode_ms=round(slowest, 3), rank_ms=[round(t, 3) for t in times], peak_bytes=peaks,
                       rel_err=_error_against(out, references[baseline_name]),
                       rel_err_vs_untiled=_error_against(out, references["untiled"]))
            base = baselines[baseline_name]
            if base["status"] == "ok":
                row.update(speedup=round(base["decode_ms"] / slowest, 3),
                           peak_fraction=round(max(peaks) / base["peak_bytes"][0], 4))
            rows.append(row)
            print(f"[rank 0] {case.key} {run}: {slowest:.2f} ms, {row.get('speedup')}x, peak fraction "
                  f"{row.get('peak_fraction')}, rel err {row['rel_err']}", flush=True)
        del out
    return rows


def write_results(case: VaeCase, rows: list[dict], args, world: int, dtype: torch.dtype,
                  device: torch.device) -> None:
    """Rank 0: ``case``'s JSON and markdown in ``args.out_dir``; prints the markdown."""
    env = harness.base_environment()
    stem = harness.record_stem(f"vae_parallel_scaling_{case.key}{'-smoke' if args.smoke else ''}_x{world}",
                               torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    latent = case.latent(args.frames)
    record = dict(benchmark="vae_parallel_scaling", environment=env, model=case.name,
                  description=case.description, latent=list(latent),
                  dtype=str(dtype).replace("torch.", ""), world_size=world, rows=rows,
                  args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    md = _markdown(env, case, latent, world, rows, args, dtype)
    harness.write_record(args.out_dir, stem, record, md)
    print(md, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun, e.g. torchrun --nproc_per_node 4 bench/vae_parallel_scaling.py", file=sys.stderr)
        return 2
    device = harness.init_torchrun_process_group(cpu=args.smoke, timeout=PROCESS_GROUP_TIMEOUT)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    for key in args.model:
        case = (SMOKE_CASES if args.smoke else CASES)[key]
        rows = run_case(case, args, device, dtype)
        if dist.get_rank() == 0:
            write_results(case, rows, args, dist.get_world_size(), dtype, device)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
