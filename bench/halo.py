#!/usr/bin/env python3
"""Benchmark of the halo kernels and of a world-size-1 spatial Wan VAE decode (one GPU).

1. **Halo kernels** at the feature-map sizes of Wan2.1's VAE decoder at 720p (latent 90x160,
   output 720x1280), each map split in two along its height (one rank's shard), bf16:
   ``halo_assemble`` (shard + 1 halo row each side into a pre-padded buffer: what every 3x3
   conv's input costs) and ``halo_pack`` (the 2 boundary rows), per backend (cuda, triton,
   torch). Bandwidth counts the bytes the op must move (read + write); the ceiling is a plain
   ``Tensor.copy_`` of the same bytes measured in the same run, and the fraction of the H200's
   measured 4.3 TB/s copy rate is printed beside it (target >= 80%).
2. **Spatial decode at world size 1**: a Wan2.1-shaped ``AutoencoderKLWan`` (random weights, the
   real widths) decoding 480p and 720p latents, diffusers' ``decode`` against the same VAE after
   ``parallelize_vae(vae, group, "spatial")`` on a one-rank NCCL group (causal convs assemble
   cached frames + input + zero halo rows into one pre-padded buffer with ``halo_assemble``, no
   communication): time (median of ``--repeats``), peak memory, and the largest difference of
   the outputs. ``--frames 21`` keeps the run short (about a minute in all on an H200).

Output: ``<out-dir>/halo_<device>_<YYYYMMDD>.json`` and ``.md``; the markdown is printed last.

    python3 bench/halo.py [--frames 81] [--repeats 3] [--skip-decode] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

if __package__:  # imported as bench.<script> (the tests)
    from bench import harness
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import harness

REPO_ROOT = Path(__file__).resolve().parents[1]

H200_COPY_BYTES_PER_S = 4.3e12  # measured HBM copy rate (shared/ANCHORS.md)
# (name, channels, height, width) of the Wan2.1 decoder's feature maps at 720p; 4 frames per
# decoder call after the first (+2 cached frames at the causal convs).
WAN_720P_MAPS = [
    ("latent 90x160 x384", 384, 90, 160),
    ("180x320 x384", 384, 180, 320),
    ("360x640 x192", 192, 360, 640),
    ("720x1280 x96", 96, 720, 1280),
]
FRAMES_PER_CALL = 6
RESOLUTIONS = {"480p": (480, 832), "720p": (720, 1280)}


def _bench_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3


def bench_kernels(dtype: torch.dtype) -> list[dict]:
    rows = []
    for name, channels, height, width in WAN_720P_MAPS:
        rows += _bench_map(name, channels, height, width, dtype)
        torch.cuda.empty_cache()  # the map's tensors died with _bench_map's frame
    return rows


def _bench_map(name: str, channels: int, height: int, width: int, dtype: torch.dtype) -> list[dict]:
    from omni_kernels.halo import HALO_RECV, HALO_ZERO, halo_assemble, halo_pack
    from omni_kernels.halo.dispatch import _ineligible_reason

    rows = []
    h = height // 2  # one rank's shard of two
    x = torch.randn(channels, FRAMES_PER_CALL, h, width, device="cuda", dtype=dtype)
    halo = torch.randn(channels, FRAMES_PER_CALL, 1, width, device="cuda", dtype=dtype)
    out = torch.empty(channels, FRAMES_PER_CALL, h + 2, width, device="cuda", dtype=dtype)
    send_lo, send_hi = torch.empty_like(halo), torch.empty_like(halo)
    esize = x.element_size()
    assemble_bytes = (x.numel() + 2 * halo.numel() + out.numel()) * esize
    pack_bytes = 4 * halo.numel() * esize
    copy_src = torch.empty(x.numel() + 2 * halo.numel(), device="cuda", dtype=dtype)
    copy_dst = torch.empty_like(copy_src)
    copy_us = _bench_us(lambda: copy_dst.copy_(copy_src))
    base = dict(map=name, shard=list(x.shape), dtype=str(dtype).replace("torch.", ""),
                copy_us=round(copy_us, 2),
                copy_tb_s=round(assemble_bytes / copy_us / 1e6, 3))
    for backend in ("cuda", "triton", "torch"):
        reason = _ineligible_reason(backend, x)
        if reason is not None:
            rows.append(dict(base, backend=backend, status=f"unavailable: {reason}"))
            continue
        try:
            out.fill_(float("nan"))
            halo_assemble(x, halo, halo, out, lo_rows=1, hi_rows=1, lo_mode=HALO_RECV,
                          hi_mode=HALO_ZERO, backend=backend)
            ok = torch.equal(out[:, :, 1:-1], x) and torch.equal(out[:, :, :1], halo) and \
                bool((out[:, :, -1:] == 0).all())
            a_us = _bench_us(lambda: halo_assemble(
                x, halo, halo, out, lo_rows=1, hi_rows=1, lo_mode=HALO_RECV,
                hi_mode=HALO_ZERO, backend=backend))
            p_us = _bench_us(lambda: halo_pack(x, send_lo, send_hi, backend=backend))
            tb_s = assemble_bytes / a_us / 1e6
            rows.append(dict(
                base, backend=backend, status="ok" if ok else "WRONG RESULT",
                assemble_us=round(a_us, 2), assemble_tb_s=round(tb_s, 3),
                assemble_vs_copy=round(copy_us / a_us, 3),
                assemble_vs_h200_ceiling=round(tb_s * 1e12 / H200_COPY_BYTES_PER_S, 3),
                pack_us=round(p_us, 2), pack_tb_s=round(pack_bytes / p_us / 1e6, 3),
            ))
        except Exception as exc:  # record and go on
            rows.append(dict(base, backend=backend,
                             status=f"error: {type(exc).__name__}: {exc}"[:300]))
    return rows


def _wan_vae(dtype):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    # Wan2.1's VAE config (the diffusers defaults): widths 96-384, 8x spatial, 4x temporal.
    return AutoencoderKLWan(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                            temperal_downsample=[False, True, True]).to("cuda", dtype).eval()


def _time_decode(vae, z, repeats: int) -> tuple[float, float, torch.Tensor]:
    times = []
    out = None
    torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats + 1):  # the first call warms up (and allocates the buffers)
        del out
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = vae.decode(z).sample
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30
    return statistics.median(times[1:]), peak, out


def bench_decode(dtype, frames: int, repeats: int) -> list[dict]:
    import torch.distributed as dist

    from omni_diffusion.vae_parallel import parallelize_vae, unparallelize_vae

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
    group = dist.group.WORLD
    vae = _wan_vae(dtype)
    latent_frames = (frames - 1) // 4 + 1
    rows = []
    for res, (height, width) in RESOLUTIONS.items():
        z = torch.randn(1, 16, latent_frames, height // 8, width // 8, device="cuda", dtype=dtype)
        row = dict(resolution=res, frames=frames, latent=list(z.shape),
                   dtype=str(dtype).replace("torch.", ""))
        try:
            with torch.no_grad():
                ref_s, ref_gib, ref = _time_decode(vae, z, repeats)
                ref = ref.cpu()
                torch.cuda.empty_cache()
                parallelize_vae(vae, group, "spatial")
                try:
                    sp_s, sp_gib, out = _time_decode(vae, z, repeats)
                finally:
                    unparallelize_vae(vae)
            diff = (out.cpu().float() - ref.float()).abs().max().item()
            row.update(status="ok", diffusers_s=round(ref_s, 3), spatial_s=round(sp_s, 3),
                       speedup=round(ref_s / sp_s, 3), diffusers_peak_gib=round(ref_gib, 2),
                       spatial_peak_gib=round(sp_gib, 2), max_abs_diff=diff)
            del out, ref
        except Exception as exc:
            row.update(status=f"error: {type(exc).__name__}: {exc}"[:300],
                       traceback=traceback.format_exc()[-3000:])
            print(row["traceback"], file=sys.stderr)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def _markdown(env, kernel_rows, decode_rows) -> str:
    lines = [f"# Halo kernels and world-size-1 spatial Wan VAE decode ({env['device']})", "",
             f"commit {env['git_commit']}, torch {env['torch']}, {env['utc']}", "",
             "## halo_assemble / halo_pack, one of two height shards, Wan2.1 decoder at 720p",
             "", "| map | shard [N,T,h,W] | backend | status | assemble us | TB/s | vs copy_ | "
             "vs 4.3 TB/s | pack us | copy_ us |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in kernel_rows:
        lines.append(f"| {r['map']} | {r['shard']} | {r['backend']} | {r['status']} | "
                     f"{r.get('assemble_us', '')} | {r.get('assemble_tb_s', '')} | "
                     f"{r.get('assemble_vs_copy', '')} | {r.get('assemble_vs_h200_ceiling', '')} | "
                     f"{r.get('pack_us', '')} | {r['copy_us']} |")
    lines += ["", "## Wan2.1-shaped AutoencoderKLWan decode, world size 1", "",
              "| resolution | latent | status | diffusers s | spatial s | speedup | diffusers GiB | "
              "spatial GiB | max abs diff |", "|---|---|---|---|---|---|---|---|---|"]
    for r in decode_rows:
        lines.append(f"| {r['resolution']} x{r['frames']}f | {r['latent']} | {r['status']} | "
                     f"{r.get('diffusers_s', '')} | {r.get('spatial_s', '')} | "
                     f"{r.get('speedup', '')} | {r.get('diffusers_peak_gib', '')} | "
                     f"{r.get('spatial_peak_gib', '')} | {r.get('max_abs_diff', '')} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=81, help="video frames to decode (4k+1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed decodes per case")
    parser.add_argument("--skip-decode", action="store_true", help="kernels only")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results",
                        help="where the .json and .md go (default: bench/results)")
    args = parser.parse_args()
    if args.frames < 1 or (args.frames - 1) % 4:
        parser.error(f"--frames must be 4k+1 (Wan's temporal compression); got {args.frames}")
    if not torch.cuda.is_available():
        print("bench/halo.py needs a CUDA GPU", file=sys.stderr)
        return 2
    env = harness.base_environment()
    dtype = torch.bfloat16
    kernel_rows = bench_kernels(dtype)
    decode_rows = [] if args.skip_decode else bench_decode(dtype, args.frames, args.repeats)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"halo_{harness.device_slug(env['device'], empty='cpu')}_{_dt.datetime.now(_dt.timezone.utc):%Y%m%d}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(
        dict(environment=env, kernels=kernel_rows, decode=decode_rows), indent=2,
        default=str) + "\n")
    table = _markdown(env, kernel_rows, decode_rows)
    (args.out_dir / f"{stem}.md").write_text(table + "\n")
    print(f"wrote {args.out_dir / stem}.json and .md", file=sys.stderr)
    print(table)
    failed = any(r["status"] not in ("ok",) and not r["status"].startswith("unavailable")
                 for r in kernel_rows + decode_rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
