"""Where a transformer step's GPU time goes: bench/pipeline.py's models and variants under
torch.profiler, kernels grouped by kind.

    python3 bench/pipeline_profile.py --model flux --variants omni_lossless omni_fp8 --out-dir bench/results

For each variant: the model (random bf16 weights at full width, as bench/pipeline.py builds it)
gets the variant applied, runs ``--warmup`` forwards, then ``--iters`` forwards under the
profiler. Per forward, the summed CUDA kernel time of each group (FP8/INT8 GEMM, bf16 GEMM,
attention, omni's quantization kernels, Inductor's fused Triton kernels, other elementwise and
copies), the sum of all kernels against the wall time of a forward (the difference is time the
GPU waits for the CPU), and the ten longest kernels. Writes
``pipeline-profile-<model>_<device>_<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

if __package__:  # imported as bench.<script> (the tests)
    from bench import harness, pipeline
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import harness
    import pipeline


#: kernel-name patterns, first match wins (cuBLAS/CUTLASS/cuDNN/Inductor naming on Hopper)
GROUPS = (
    # Inductor's kernels first: their names list the ops they fused, attention's included
    ("inductor triton", re.compile(r"^triton_(poi|red|per|tem)_")),
    # cuBLASLt names its FP8 kernels nvjet_*_qqtst_*
    ("gemm fp8/int8", re.compile(r"qqtst|e4m3|f8f8|fp8_gemm|float_e4m3|i8i8|s8s8|int8.*gemm|scaled_gemm|imma", re.I)),
    ("attention", re.compile(r"fmha|flash|attn|attention|cudnn|sdpa|_fwd_kernel", re.I)),
    ("gemm bf16", re.compile(r"gemm|nvjet|xmma|cutlass|sm90_|wgmma|matmul", re.I)),
    ("omni quantization", re.compile(r"quantiz|per_token", re.I)),
    ("other", re.compile(r".")),
)


def group_of(name: str) -> str:
    return next(group for group, pattern in GROUPS if pattern.search(name))


def profile_variant(model, inputs, device, warmup: int, iters: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        pipeline.forward_once(model, inputs)
    pipeline.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        pipeline.forward_once(model, inputs)
    pipeline.synchronize(device)
    wall_ms = (time.perf_counter() - start) * 1e3 / iters
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            pipeline.forward_once(model, inputs)
        pipeline.synchronize(device)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            entry = kernels[event.name]
            entry[0] += event.device_time_total / 1e3 / iters  # us -> ms, per forward
            entry[1] += 1
    groups: dict[str, float] = defaultdict(float)
    for name, (ms, _) in kernels.items():
        groups[group_of(name)] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:10]
    return dict(
        wall_ms=round(wall_ms, 3),
        kernel_ms=round(sum(groups.values()), 3),
        groups={g: round(groups.get(g, 0.0), 3) for g, _ in GROUPS},
        top_kernels=[dict(name=name[:160], group=group_of(name), ms=round(ms, 3), calls=count // iters)
                     for name, (ms, count) in top],
    )


def markdown(env: dict, model_key: str, rows: dict) -> str:
    names = [g for g, _ in GROUPS]
    lines = [
        f"# Where the step time goes: {pipeline.MODELS[model_key].name} ({env['device']})", "",
        f"commit {env['git_commit']}, torch {env['torch']} (CUDA {env['cuda']}), "
        + ", ".join(f"{k} {v}" for k, v in env.get("packages", {}).items()) + f", {env['utc']}", "",
        f"command: `{env['command']}`", "",
        "ms per forward, CUDA kernel time summed by group (torch.profiler)", "",
        "| variant | wall | kernels | " + " | ".join(names) + " |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in names) + " |",
    ]
    for variant, r in rows.items():
        if "error" in r:
            lines.append(f"| {pipeline.VARIANT_LABELS[variant]} | {r['error']} |")
            continue
        lines.append(f"| {pipeline.VARIANT_LABELS[variant]} | {r['wall_ms']:.1f} | {r['kernel_ms']:.1f} | "
                     + " | ".join(f"{r['groups'][g]:.1f}" for g in names) + " |")
    for variant, r in rows.items():
        if "error" in r:
            continue
        lines += ["", f"Longest kernels, {pipeline.VARIANT_LABELS[variant]} (ms per forward, calls per forward):", ""]
        lines += [f"- {k['ms']:.2f} ms x{k['calls']} [{k['group']}] `{k['name']}`" for k in r["top_kernels"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(pipeline.MODELS), default="flux")
    parser.add_argument("--variants", nargs="+", choices=pipeline.VARIANTS, default=["omni_lossless", "omni_fp8"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/pipeline_profile.py profiles CUDA kernels: no CUDA device here", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), torch.bfloat16
    spec = pipeline.MODELS[args.model]
    model = pipeline.build_transformer(spec, device, dtype)
    inputs = pipeline.make_inputs(spec, device, dtype)
    rows = {}
    for variant in args.variants:
        undo = None
        try:
            undo = pipeline.apply_variant(variant, model, device, args, spec)
            rows[variant] = profile_variant(model, inputs, device, args.warmup, args.iters)
        except pipeline.Skip as exc:
            rows[variant] = dict(error=f"skipped: {exc}")
        finally:
            if undo is not None:
                undo()
            torch._dynamo.reset()
        print(variant, json.dumps(rows[variant])[:600], flush=True)
    env = harness.base_environment()
    env["command"] = " ".join(["python3", "bench/pipeline_profile.py", *(argv or sys.argv[1:])])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / (f"pipeline-profile-{args.model}_{harness.device_slug(env['device'])}_"
                           f"{_dt.date.today():%Y%m%d}")
    stem.with_suffix(".json").write_text(json.dumps(dict(environment=env, model=spec.name, rows=rows), indent=2))
    text = markdown(env, args.model, rows)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
