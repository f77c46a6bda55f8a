"""Tune omni's quantized attention (``omni_sage``: INT8 QK^T, FP8 PV) against cuDNN and sageattention.

For each shape (bf16, non-causal, bhsd) this times, with
``triton.testing.do_bench(return_mode="median")``:

* torch SDPA on cuDNN (the baseline) and sageattention (when installed, through
  ``omni_kernels.attention.attention(backend="sageattention")``);
* omni's quantized forward (:func:`sage_attention_forward`: quantization
  kernels + attention kernel) under each config of ``CONFIGS``;
* for the default config, the quantization alone and the attention kernel alone.

TFLOP/s-equivalent is ``4*B*H*Sq*Skv*D / t``. Accuracy is checked on a subset
(2 heads, the first 1024 queries, all keys) against float32 attention, on two
input sets: ``randn`` (the bench/attention.py inputs) and ``dit`` (the DiT-like
inputs of :func:`dit_like_qkv`: Q/K outlier channels, K channel bias, V channel
means), printing the mean per-row cosine and the relative L2 error for omni and
sageattention. Everything goes to ``<out-dir>/quantized_attention_tune.json``,
rewritten after every row.

Usage (on the H200; a few minutes, mostly Triton compiles and the video shapes)::

    PYTHONPATH=. python3 bench/quantized_attention_tune.py --out-dir $OUT

Options: ``--shapes flux,wan720,hunyuan`` (also wan480), ``--configs 0,2``
(indices into CONFIGS), ``--no-check``. Under two minutes on an H200:
``--shapes flux,wan720 --configs 1,3,5,6,7,9`` (the default always runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

if __package__:  # imported as bench.<script> (the tests)
    from bench import harness
    from bench import shapes as models
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import harness
    import shapes as models

import triton

from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from omni_kernels.attention import attention, get_backend, select_backend
from omni_kernels.attention.quantized.attention_kernel import (
    CUDA_SM90_CONFIG,
    SageConfig,
    cuda_sm90_unsupported_reason,
    default_config,
    sage_attention_forward,
    sage_attention_quantized,
)
from omni_kernels.attention.quantized.quantize import quantize_qkv
from omni_kernels.attention.quantized.quantize_cuda import quantize_qkv_cuda
from omni_kernels.attention.quantized.reference import dit_like_qkv

# name: (B, H, S, D)
SHAPES = {
    "flux": models.FLUX.bhsd(),
    "wan720": models.WAN_720P.bhsd(),
    "hunyuan": models.HUNYUAN_720P.bhsd(),
    "wan480": models.WAN_480P.bhsd(),
}
DEFAULT_SHAPES = ("flux", "wan720", "hunyuan")

C = SageConfig
# Run 3 on the H200 (Triton 3.6): M64xN128 w4 s3 fastest (468 / 678 / 683 TFLOP/s at
# Flux / Wan 720p / Hunyuan 720p), M128xN128 w8 s3 409 / 642 / 646, s2 and N64
# slower, every +tma failed to compile (int64 TMA coordinates, fixed since).
# Candidates toward 1.5x cuDNN: the winner with TMA (the pointer path is not
# multi-buffered in shared memory; TMA is, 3-4 stages), deeper pipelines,
# Triton's warp specialization on the two-warpgroup tile, and smaller N tiles.
CONFIGS = [
    C(64, 128, 4, 3),                                       # 0: default on Hopper, D=128
    C(64, 128, 4, 3, use_tma=True),                         # 1
    C(64, 128, 4, 4),                                       # 2
    C(64, 128, 4, 4, use_tma=True),                         # 3
    C(128, 128, 8, 3),                                      # 4: previous default
    C(128, 128, 8, 3, use_tma=True),                        # 5
    C(128, 128, 8, 3, warp_specialize=True),                # 6
    C(128, 128, 8, 3, use_tma=True, warp_specialize=True),  # 7
    C(64, 64, 4, 4),                                        # 8
    C(64, 64, 4, 4, use_tma=True),                          # 9
    CUDA_SM90_CONFIG,                                       # 10: the Hopper CUDA (wgmma) kernel
    C(64, 128, 4, 3, score_bias=True),                      # 11: 0 without the int-to-float conversion
    C(128, 128, 8, 3, score_bias=True),                     # 12: 4 likewise
    replace(CUDA_SM90_CONFIG, cuda_quantizer=True),         # 13: 10 on the CUDA quantizer
]
# Until cadb6a2, 13-15 were the cuda_sm90 kernel with exp2 of 2/3/4 of 8 scores on the FMA
# pipes (all slower; the option is gone) and the CUDA quantizer was 16: results files name
# configs by those indices.
CHECK_HEADS = 2
CHECK_QUERIES = 1024


def flops(b, h, s, d):
    return 4.0 * b * h * s * s * d


def errors(out, q, k, v):
    """(mean row cosine, rel L2) of out[:, :2, :1024] against float32 attention."""
    qs = q[:, :CHECK_HEADS, :CHECK_QUERIES].float()
    ks, vs = k[:, :CHECK_HEADS].float(), v[:, :CHECK_HEADS].float()
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        ref = sdpa(qs, ks, vs)
    o = out[:, :CHECK_HEADS, :CHECK_QUERIES].float()
    cos = torch.nn.functional.cosine_similarity(o.double(), ref.double(), dim=-1).mean().item()
    return cos, ((o - ref).norm() / ref.norm()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    parser.add_argument("--configs", default="all", help="'all' or comma-separated indices into CONFIGS")
    parser.add_argument("--out-dir", "--out", dest="out",
                        default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        sys.exit("quantized_attention_tune.py needs a CUDA GPU")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the tuning must run compiled Triton kernels")
    device = torch.device("cuda")
    configs = CONFIGS if args.configs == "all" else [CONFIGS[int(i)] for i in args.configs.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / "quantized_attention_tune.json"
    props = torch.cuda.get_device_properties(device)
    sage_reason = get_backend("sageattention").unavailable_reason(device)
    env = harness.base_environment(("triton", "sageattention"))
    report = {"gpu": props.name, "capability": list(torch.cuda.get_device_capability(device)),
              "torch": torch.__version__, "triton": triton.__version__,
              "sageattention": sage_reason or "available", "environment": env, "results": []}
    md_lines = [
        "# Quantized attention (omni_sage) configs against cuDNN and sageattention",
        "",
        f"- device: {env['device']} ({env['arch']}); torch {env['torch']} (CUDA {env['cuda']}), "
        + ", ".join(f"{k} {v}" for k, v in env["packages"].items()),
        f"- git commit: {env['git_commit']}; {env['utc']}",
        f"- command: `{env['command']}`",
        "- do_bench medians; TFLOP/s-equivalent = 4*B*H*S*S*D / t; quantization included unless the row "
        "says 'only'",
        "",
        "```",
    ]

    def say(text: str = "") -> None:
        print(text)
        md_lines.append(text)

    say(f"{props.name} sm_{props.major}{props.minor}, torch {torch.__version__}, triton {triton.__version__}; "
        f"sageattention: {sage_reason or 'available'}")

    def save():
        out_file.write_text(json.dumps(report, indent=1))
        out_file.with_suffix(".md").write_text("\n".join(md_lines + ["```", ""]))

    start = time.time()
    summary = []
    for shape_name in args.shapes.split(","):
        b, h, s, d = SHAPES[shape_name]
        fl = flops(b, h, s, d)
        gen = torch.Generator(device=device).manual_seed(1234)
        q, k, v = (torch.randn(b, h, s, d, generator=gen, device=device, dtype=torch.bfloat16)
                   for _ in range(3))
        probe = triton.testing.do_bench(lambda: sdpa(q, k, v), warmup=5, rep=20, return_mode="median")
        warm, rep = max(25.0, 2 * probe), max(100.0, 6 * probe)
        rows = []

        def record(name, ms, extra=None):
            row = {"shape": shape_name, "dims": [b, h, s, d], "impl": name, "ms": ms,
                   "tflops": fl / (ms * 1e-3) / 1e12 if ms else None}
            row.update(extra or {})
            rows.append(row)
            report["results"].append(row)
            save()

        def timed(name, fn, extra=None):
            try:
                fn()
                torch.cuda.synchronize()
                record(name, triton.testing.do_bench(fn, warmup=warm, rep=rep, return_mode="median"), extra)
            except Exception as exc:  # a config that does not compile / fit, a missing package
                record(name, None, {"error": f"{type(exc).__name__}: {exc}"[:300]})
                traceback.print_exc(limit=2)

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            timed("cudnn", lambda: sdpa(q, k, v))
        if sage_reason is None and select_backend(q, k, v, backend="sageattention")[0]:
            timed("sageattention", lambda: attention(q, k, v, backend="sageattention"))
        dflt = default_config(d, device)
        cands = [dflt] + [c for c in configs if c != dflt]
        for cfg in cands:
            out = torch.empty_like(q)
            timed(cfg.describe() + (" (default)" if cfg == dflt else ""),
                  lambda cfg=cfg, out=out: sage_attention_forward(q, k, v, out=out, config=cfg),
                  {"config": cfg.__dict__})
        # where the default's time goes
        qkv = quantize_qkv(q, k, v, block_n=dflt.block_n)
        out = torch.empty_like(q)
        # two launches: K's mean over its strided sample, then the Q/K/V codes (each read once)
        timed("  quantization only", lambda: quantize_qkv(q, k, v, block_n=dflt.block_n))
        timed("  attention kernel only", lambda: sage_attention_quantized(
            qkv, out, layout="bhsd", scale=d ** -0.5, config=dflt))
        cuda_reason = cuda_sm90_unsupported_reason(device, d, q.dtype)
        cuda_configs = [c for c in configs if c.kernel == "cuda_sm90"] if cuda_reason is None else []
        if cuda_configs:
            timed("  cuda_sm90: CUDA quantization only",
                  lambda: quantize_qkv_cuda(q, k, v, permute_v=True))
            timed("  cuda_sm90: Triton quantization (V^T permuted) only",
                  lambda: quantize_qkv(q, k, v, block_n=128, permute_v=True))
            qkv = quantize_qkv(q, k, v, block_n=128, permute_v=True)
            # the kernel alone (the quantizer configs share it)
            timed("  cuda_sm90: attention kernel only",
                  lambda: sage_attention_quantized(qkv, out, layout="bhsd", scale=d ** -0.5,
                                                   config=CUDA_SM90_CONFIG))
        qkv = out = None  # free before the accuracy inputs

        if not args.no_check:
            for kind in ("randn", "dit"):
                if kind == "dit":
                    q, k, v = dit_like_qkv(gen, (b, h, s, d), torch.bfloat16, device)
                checks = [("omni_sage", lambda: sage_attention_forward(q, k, v))]
                checks += [(f"omni_sage {cfg.describe()}",
                            lambda cfg=cfg: sage_attention_forward(q, k, v, config=cfg)) for cfg in cuda_configs]
                checks.append(("sageattention", lambda: attention(q, k, v, backend="sageattention")))
                for name, fn in checks:
                    if name == "sageattention" and (sage_reason or not select_backend(q, k, v, backend=name)[0]):
                        continue
                    cos, rel = errors(fn(), q, k, v)
                    row = {"shape": shape_name, "impl": f"accuracy {name} {kind}", "cosine": cos, "rel_l2": rel}
                    report["results"].append(row)
                    rows.append(row)
                    save()

        cudnn_ms = next((r["ms"] for r in rows if r["impl"] == "cudnn" and r.get("ms")), None)
        say(f"\n== {shape_name}: B={b} H={h} S={s} D={d} bf16 bhsd")
        say(f"{'impl':34s} {'ms':>9s} {'TFLOP/s':>8s} {'vs cuDNN':>8s}")
        for r in rows:
            if "cosine" in r:
                say(f"{r['impl']:34s} cosine {r['cosine']:.5f}  rel L2 {r['rel_l2']:.3e}")
            elif r["ms"] is None:
                say(f"{r['impl']:34s} {'-':>9s}  {r.get('error', '')[:70]}")
            else:
                r["vs_cudnn"] = cudnn_ms / r["ms"] if cudnn_ms else None
                say(f"{r['impl']:34s} {r['ms']:9.3f} {r['tflops']:8.1f} {r['vs_cudnn'] or 0:8.3f}")
        ours = [r for r in rows if r.get("ms") and "config" in r]
        if ours:
            best = min(ours, key=lambda r: r["ms"])
            summary.append((shape_name, best["impl"], best["tflops"], best.get("vs_cudnn")))
        save()
        q = k = v = None
        torch.cuda.empty_cache()

    say("\n== best omni_sage config per shape (targets: >= 1.5x cuDNN at Wan/Hunyuan 720p, >= 1.3x at Flux)")
    for name, impl, tf, ratio in summary:
        say(f"{name:10s} {impl:34s} {tf:8.1f} TFLOP/s  {ratio or 0:.3f}x cuDNN")
    report["elapsed_s"] = time.time() - start
    save()
    print(f"\nwrote {out_file} and its .md ({report['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
