#!/usr/bin/env python3
"""omni's per-token activation quantization kernels, CUDA C++ and Triton, side by side.

``torch.ops.omni_kernels.quantize_per_token`` (csrc/quant: one thread block per row, the row in
registers in 16-byte vectors) and ``torch.ops.omni_kernels.quantize_per_token_triton`` on the same
inputs in one process, plain and fused with LayerNorm + adaLN (the Flux/SD3 block input), at the
Flux and Wan2.1-14B linear-input shapes. The two are checked against each other (scales within
1e-5 relative, codes equal in at least 99% of the values: their float32 sums may round apart). Median of ``triton.testing.do_bench`` (L2 flushed before
each call); GB/s over the bytes a kernel must move (input read once, 8-bit output written once).

    python3 bench/quant_per_token.py --out-dir bench/results
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench._environment import base_environment, device_slug, gpu_refusal  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str
    rows: int
    cols: int
    note: str


SHAPES = {
    s.name: s for s in (
        Shape("flux-3072", 4608, 3072, "Flux.1 1024^2: attention projections and MLP up input"),
        Shape("flux-12288", 4608, 12288, "Flux.1 1024^2: MLP down input"),
        Shape("flux-15360", 4608, 15360, "Flux.1 1024^2: single blocks' proj_out input"),
        Shape("wan14b-5120", 75600, 5120, "Wan2.1-14B 720p 81 frames: attention projections"),
        Shape("wan14b-13824", 75600, 13824, "Wan2.1-14B 720p 81 frames: FFN down input"),
        Shape("tiny", 37, 200, "smoke test"),
    )
}
DEFAULT_SHAPES = ("flux-3072", "flux-12288", "flux-15360", "wan14b-5120", "wan14b-13824")


def _bench_us(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def run_shape(shape: Shape, fused: bool, dtype: torch.dtype, seed: int) -> list[dict]:
    from torch._library.triton import set_wrap_triton_enabled

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape.rows, shape.cols, device="cuda", generator=gen).to(dtype)
    x[:, :: max(1, shape.cols // 3)] *= 20  # outlier channels
    norm, weight, bias, mod_scale, mod_shift = 0, None, None, None, None
    if fused:  # LayerNorm without affine, then adaLN modulation: one [1, K] row of each
        norm = 2
        mod_scale = (0.1 * torch.randn(1, shape.cols, device="cuda", generator=gen)).to(dtype)
        mod_shift = (0.1 * torch.randn(1, shape.cols, device="cuda", generator=gen)).to(dtype)
    args = (x, weight, bias, mod_scale, mod_shift, norm, 1e-6, 0.0, torch.float8_e4m3fn)
    nbytes = shape.rows * shape.cols * (x.element_size() + 1)
    kind = "layernorm+adaln" if fused else "plain"
    rows = []
    with set_wrap_triton_enabled(False):  # launch as eager and Inductor-generated calls do
        q_t, s_t = torch.ops.omni_kernels.quantize_per_token_triton(*args)
        q_c, s_c = torch.ops.omni_kernels.quantize_per_token(*args)
        steps = (q_c.float() - q_t.float()).abs()
        agree = bool(torch.allclose(s_c, s_t, rtol=1e-5, atol=0)
                     and (q_c.float() != q_t.float()).float().mean() < 0.01)
        for label, op in (("cuda", torch.ops.omni_kernels.quantize_per_token),
                          ("triton", torch.ops.omni_kernels.quantize_per_token_triton)):
            us = _bench_us(lambda op=op: op(*args))
            rows.append(dict(shape=shape.name, kind=kind, setting=label, us=us, gbps=nbytes / us / 1e3,
                             status="ok" if agree else f"cuda and triton differ (largest code difference {steps.max().item():.3g})"))
    return rows


def markdown(env: dict, shapes: list[Shape], rows: list[dict], dtype: str) -> str:
    lines = ["# Per-token activation quantization: CUDA C++ vs Triton", "",
             f"- device: {env['device']}; torch {env['torch']} (CUDA {env['cuda']}), "
             f"triton {env['packages'].get('triton')}; input {dtype}, FP8 e4m3 output",
             f"- git commit: {env['git_commit']}; {env['utc']}",
             f"- command: `{env['command']}`",
             "- median us of triton.testing.do_bench (L2 flushed); GB/s over input read once + output written once;"
             " the two kernels' scales agree within 1e-5 and their codes in 99% of the values.", ""]
    for shape in shapes:
        for kind in ("plain", "layernorm+adaln"):
            mine = [r for r in rows if r["shape"] == shape.name and r["kind"] == kind]
            if not mine:
                continue
            lines += [f"## {shape.name} ({kind}): {shape.note}, {shape.rows} x {shape.cols}", "",
                      "| kernel | median us | GB/s | vs cuda | status |", "| --- | ---: | ---: | ---: | --- |"]
            auto = next((r.get("us") for r in mine if r["setting"] == "cuda"), None)
            for r in mine:
                us = r.get("us")
                ratio = f"{auto / us:.2f}x" if us and auto else "-"
                lines.append(f"| {r['setting']} | {us:.1f} | {r['gbps']:.0f} | {ratio} | {r['status']} |"
                             if us else f"| {r['setting']} | - | - | - | {r['status']} |")
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(DEFAULT_SHAPES))
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    refusal = gpu_refusal("bench/quant_per_token.py")
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    from omni_kernels._extension import has_compiled_extension

    if not has_compiled_extension():
        print("bench/quant_per_token.py needs omni's compiled CUDA extension (omni_kernels._C): "
              "build it first (pip install -e . or scripts/device_gpu.sh build)", file=sys.stderr)
        return 2
    import omni_kernels.quant  # noqa: F401  (registers the Triton op and the fakes)

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    env = base_environment(("triton",))
    shapes = [SHAPES[name] for name in args.shapes]
    rows = []
    for shape in shapes:
        for fused in (False, True):
            rows += run_shape(shape, fused, dtype, args.seed)
        torch.cuda.empty_cache()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"quant_per_token_{device_slug(env['device'])}_{_dt.datetime.now(_dt.timezone.utc):%Y%m%d}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(
        dict(environment=env, dtype=args.dtype, shapes=[vars(s) for s in shapes], results=rows),
        indent=2, default=str) + "\n")
    table = markdown(env, shapes, rows, args.dtype)
    (args.out_dir / f"{stem}.md").write_text(table + "\n")
    print(table)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
