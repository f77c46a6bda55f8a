"""Tune omni's Triton attention forward against cuDNN and flash SDPA on one GPU.

For each shape (bf16, non-causal unless named so) this times omni's kernel
(:func:`omni_kernels.attention.triton_flash.flash_attention_forward`) under a
short list of candidate configs, plus torch SDPA on its cuDNN and flash
backends, with ``triton.testing.do_bench(return_mode="median")``. Each omni
config's output is checked against fp32 SDPA math on a subset (2 heads, the
first 1024 queries, all keys). It prints a table of TFLOP/s
(``4*B*H*Sq*Skv*D / t``, halved for causal) with the ratio to cuDNN, and writes
everything to ``<out>/attention_tune.json`` (rewritten after every row, so a
crash keeps what was measured).

Usage (on the H200; about 2-3 minutes, most of it Triton compiles)::

    PYTHONPATH=. python3 bench/attention_tune.py --out $OUT

Options: ``--shapes flux,sd35,wan480`` (also: wan_cross, flux_causal, d256,
flux_bshd), ``--configs 0,3,5`` (indices into CONFIGS), ``--no-check``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from omni_kernels.attention.triton_flash import (
    AttentionConfig,
    default_config,
    flash_attention_forward,
    kernel_resource_usage,
)

if __package__:  # imported as bench.<script> (the tests)
    from bench import shapes as models
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import shapes as models

# name: (B, H, Sq, Skv, D, causal, layout)
def _self_attention(model: models.Model, causal: bool = False, layout: str = "bhsd") -> tuple:
    return 1, model.heads, model.tokens, model.tokens, model.head_dim, causal, layout


_WAN = models.WAN_480P
SHAPES = {
    "flux": _self_attention(models.FLUX),
    "sd35": _self_attention(models.SD35),
    "wan480": _self_attention(_WAN),
    # extras, not run by default
    "wan_cross": (1, _WAN.heads, _WAN.tokens, models.TEXT_TOKENS, _WAN.head_dim, False, "bhsd"),
    "flux_causal": _self_attention(models.FLUX, causal=True),
    "flux_bshd": _self_attention(models.FLUX, layout="bshd"),
    "d256": (1, 16, 4096, 4096, 256, False, "bhsd"),
}
DEFAULT_SHAPES = ("flux", "sd35", "wan480")

C = AttentionConfig
# Focused candidates (the best of a wider sweep, EXPLORE_CONFIGS, on an H200):
# BLOCK_M=128 / 8 warps (two consumer warpgroups of 64 rows) with BLOCK_N
# 64/128, 2-4 stages, TMA or cp.async loads; a register-capped variant (two
# CTAs per SM); the source-pipelined Q K^T; narrow key blocks for D=256.
CONFIGS = [
    C(128, 128, 8, 3, use_tma=True),  # D=128 default on Hopper
    C(128, 128, 8, 3),
    C(128, 128, 8, 2, use_tma=True),
    C(128, 64, 8, 3),  # D=64 default on Hopper
    C(128, 64, 8, 3, use_tma=True),
    C(128, 64, 8, 4, use_tma=True),
    C(128, 64, 8, 2, maxnreg=128),
    C(128, 64, 8, 3, use_tma=True, pipeline_qk=True),
    C(128, 64, 8, 2),
    C(128, 32, 8, 3),  # D=256 default on Hopper
    C(128, 32, 8, 4),
    C(64, 64, 4, 3),
    C(128, 128, 8, 3, use_tma=True, warp_specialize=True),
    C(128, 128, 8, 2, use_tma=True, warp_specialize=True),
    C(128, 64, 8, 3, use_tma=True, warp_specialize=True),
]
# --explore: a wider sweep (occupancy: register caps for two CTAs per SM,
# 64-row blocks, deeper pipelines).
EXPLORE_CONFIGS = [
    C(128, 128, 8, 3),
    C(128, 128, 8, 4),
    C(128, 128, 8, 3, use_tma=True),
    C(128, 64, 8, 4, use_tma=True),
    C(128, 64, 8, 3, maxnreg=128),
    C(128, 64, 8, 2, maxnreg=128),
    C(128, 128, 8, 3, maxnreg=168),
    C(64, 64, 4, 2),
    C(64, 64, 4, 3, maxnreg=128),
    C(64, 64, 4, 4),
    C(64, 128, 4, 2),
    C(64, 128, 4, 3),
]

CHECK_HEADS = 2
CHECK_QUERIES = 1024
ERR_LIMIT = 5e-3


def flops(b, h, sq, skv, d, causal):
    f = 4.0 * b * h * sq * skv * d
    return f / 2 if causal else f


def make_inputs(shape, dtype, device, gen):
    b, h, sq, skv, d, causal, layout = shape

    def act(*s):
        x = torch.randn(*s, device=device, dtype=torch.float32, generator=gen)
        ch = torch.randperm(d, device=device, generator=gen)[:3]
        x[..., ch] *= 10.0  # a few outlier channels, as in real q/k projections
        return x.to(dtype)

    if layout == "bhsd":
        return act(b, h, sq, d), act(b, h, skv, d), act(b, h, skv, d)
    # bshd as a DiT produces it: views into one fused [B, S, 3, H, D] projection
    if sq == skv:
        qkv = act(b, sq, 3, h, d)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    kv = act(b, skv, 2, h, d)
    return act(b, sq, h, d), kv[:, :, 0], kv[:, :, 1]


def to_bhsd(x, layout):
    return x if layout == "bhsd" else x.transpose(1, 2)


def reference_subset(q, k, v, layout, causal):
    """fp32 SDPA math on heads [:CHECK_HEADS] and queries [:CHECK_QUERIES] (all keys)."""
    qb, kb, vb = (to_bhsd(t, layout)[:, :CHECK_HEADS].float() for t in (q, k, v))
    qb = qb[:, :, :CHECK_QUERIES]
    with sdpa_kernel(SDPBackend.MATH):
        return sdpa(qb, kb, vb, is_causal=causal)


def rel_err(out, ref, layout):
    o = to_bhsd(out, layout)[:, :CHECK_HEADS, :CHECK_QUERIES].double()
    r = ref.double()
    return ((o - r).norm() / r.norm()).item()


def bench(fn, warmup_ms, rep_ms):
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    parser.add_argument("--configs", default="all", help="'all' or comma-separated indices into CONFIGS")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--explore", action="store_true", help="sweep EXPLORE_CONFIGS instead")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = parser.parse_args()

    if not torch.cuda.is_available():
        sys.exit("attention_tune.py needs a CUDA GPU")
    device = torch.device("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    pool = EXPLORE_CONFIGS if args.explore else CONFIGS
    configs = pool if args.configs == "all" else [pool[int(i)] for i in args.configs.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / "attention_tune.json"
    props = torch.cuda.get_device_properties(device)
    report = {
        "gpu": props.name,
        "capability": list(torch.cuda.get_device_capability(device)),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype),
        "results": [],
    }
    print(f"{props.name} sm_{props.major}{props.minor}, torch {torch.__version__}, triton {triton.__version__}")

    def save():
        out_file.write_text(json.dumps(report, indent=1))

    t_start = time.time()
    summary = []
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        b, h, sq, skv, d, causal, layout = shape
        gen = torch.Generator(device=device)
        gen.manual_seed(1234)
        q, k, v = make_inputs(shape, dtype, device, gen)
        fl = flops(b, h, sq, skv, d, causal)
        # Long problems (Wan: ~35 ms a call) get a longer window so the median has samples.
        probe = bench(lambda: flash_attention_forward(q, k, v, layout=layout, causal=causal), 5, 20)
        rep = max(args.rep_ms, 8 * probe)
        warm = max(args.warmup_ms, 2 * probe)
        ref = None if args.no_check else reference_subset(q, k, v, layout, causal)
        rows = []

        def record(name, ms, err, extra=None):
            tflops = fl / (ms * 1e-3) / 1e12 if ms else None
            row = {"shape": shape_name, "dims": list(shape), "impl": name, "ms": ms,
                   "tflops": tflops, "rel_err": err}
            if extra:
                row.update(extra)
            rows.append(row)
            report["results"].append(row)
            save()
            return row

        # torch SDPA backends take [B, H, S, D]
        qb, kb, vb = (to_bhsd(t, layout) for t in (q, k, v))
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    fn = lambda: sdpa(qb, kb, vb, is_causal=causal)  # noqa: E731
                    o = fn()
                    err = None if ref is None else rel_err(from_bhsd_like(o, layout), ref, layout)
                    ms = bench(fn, warm, rep)
                record(name, ms, err)
            except Exception as e:  # backend unavailable for this shape
                record(name, None, None, {"error": f"{type(e).__name__}: {e}"[:300]})

        cands = list(configs)
        dflt = default_config(d, causal, dtype, device)
        if dflt not in cands:
            cands.insert(0, dflt)
        for cfg in cands:
            name = cfg.describe() + (" (default)" if cfg == dflt else "")
            try:
                out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
                fn = lambda: flash_attention_forward(  # noqa: E731
                    q, k, v, layout=layout, causal=causal, out=out, config=cfg)
                fn()
                torch.cuda.synchronize()
                unwritten = int(torch.isnan(out).sum().item())
                err = None if ref is None else rel_err(out, ref, layout)
                ms = bench(fn, warm, rep)
                ok = unwritten == 0 and (err is None or err <= ERR_LIMIT)
                res = kernel_resource_usage(q, k, v, layout=layout, causal=causal, config=cfg)
                record(name, ms, err, {"config": cfg.__dict__, "ok": ok, "unwritten": unwritten, **res})
            except Exception as e:  # config does not compile / fit
                record(name, None, None, {"config": cfg.__dict__, "error": f"{type(e).__name__}: {e}"[:300]})
                traceback.print_exc(limit=1)

        cudnn_ms = next((r["ms"] for r in rows if r["impl"] == "cudnn" and r["ms"]), None)
        for r in rows:
            r["vs_cudnn"] = (cudnn_ms / r["ms"]) if (cudnn_ms and r["ms"]) else None
        save()
        print(f"\n== {shape_name}: B={b} H={h} Sq={sq} Skv={skv} D={d} causal={causal} {layout} {args.dtype}")
        print(f"{'impl':34s} {'ms':>8s} {'TFLOP/s':>8s} {'vs cuDNN':>8s} {'rel err':>9s}  regs/spill/smem")
        for r in rows:
            if r["ms"] is None:
                print(f"{r['impl']:34s} {'-':>8s}  {r.get('error', '')[:60]}")
                continue
            bad = "" if r.get("ok", True) else "  FAILED CHECK"
            err = f"{r['rel_err']:.2e}" if r["rel_err"] is not None else "-"
            res = ""
            if "n_regs" in r:
                res = f"  {r['n_regs']}/{r['n_spills']}/{(r['shared'] or 0) // 1024}K"
            print(f"{r['impl']:34s} {r['ms']:8.3f} {r['tflops']:8.1f} {r['vs_cudnn'] or 0:8.3f} {err:>9s}{res}{bad}")
        omni = [r for r in rows if r["ms"] and r.get("ok") and "config" in r]
        if omni:
            best = min(omni, key=lambda r: r["ms"])
            summary.append((shape_name, best["impl"], best["tflops"], best["vs_cudnn"]))
        q = k = v = qb = kb = vb = ref = None  # free the inputs before the next shape
        torch.cuda.empty_cache()

    print("\n== best omni config per shape")
    for name, impl, tf, ratio in summary:
        print(f"{name:12s} {impl:34s} {tf:8.1f} TFLOP/s  {ratio or 0:.3f}x cuDNN")
    report["elapsed_s"] = time.time() - t_start
    save()
    print(f"\nwrote {out_file} ({report['elapsed_s']:.0f} s)")


def from_bhsd_like(o, layout):
    """SDPA returns [B, H, S, D]; view it in ``layout`` for rel_err."""
    return o if layout == "bhsd" else o.transpose(1, 2)


if __name__ == "__main__":
    main()
