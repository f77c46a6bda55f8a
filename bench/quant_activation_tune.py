#!/usr/bin/env python3
"""Launch settings of omni's GELU-folded activation quantization, side by side.

:func:`omni_kernels.quant.quantize_activated_per_token`'s Triton kernel quantizes the input of
every layer that reads a GELU (a DiT's MLP down projection; Flux's single blocks' ``proj_out``,
whose attention half comes in through ``prefix``). In the compiled FP8 Flux step on an H200 it
moved ~2 TB/s (bench/results/pipeline-profile/pipeline-profile-flux-*_20261130.md: 6.4 ms for 76 calls). This
times, on the same inputs in one process, each setting the launcher offers:

* ``tile``: the row in one register tile (the default for rows up to ``MAX_TILE``), with the
  warp counts 4, 8 (default), 16 and 32, keeping the activated row (``keep``) or only the
  16-bit input and applying the GELU again for the store (``recompute``: meant to use fewer
  registers a thread, so more rows in flight; with Triton 3.6 it compiles to the default's code,
  the two GELUs merged);
* ``chunked-N``: N-wide chunks read twice (the second read from L2), 4 or 8 warps;
* for the prefix shape, ``cat+kernel``: what the fold cost before the prefix (a ``torch.cat``
  then the kernel on the cat);
* ``cuda``: omni's CUDA C++ kernel (``torch.ops.omni_kernels.quantize_activated``, when the
  extension is built), whose codes may differ from the Triton kernel's where the two GELUs
  round apart (checked: scales within 1e-5, codes equal in 99% of the values).

Every setting's codes and scales are compared with the default's (they must be equal: the
settings change scheduling, not arithmetic). Median of ``triton.testing.do_bench`` (L2 flushed
before each call), launches outside ``torch.library.wrap_triton``'s tracing path as the op's
eager and Inductor-generated calls are; GB/s over the bytes the kernel must move (input read
once, 8-bit output written once).

    python3 bench/quant_activation_tune.py --out-dir bench/results
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if __package__:  # imported as bench.<script> (the tests)
    from bench import harness
    from bench import shapes as models
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import harness
    import shapes as models



@dataclass(frozen=True)
class Shape:
    name: str
    rows: int
    prefix: int  # columns taken as they are, before the activated ones (0: none)
    width: int  # activated columns
    note: str


_FLUX, _WAN = models.FLUX, models.WAN_480P
SHAPES = {
    s.name: s for s in (
        Shape("flux-single-proj-out", _FLUX.tokens, _FLUX.width, _FLUX.ffn,
              "Flux.1 1024^2 single block: cat(attention, GELU(mlp))"),
        Shape("flux-ff-down", _FLUX.tokens - models.TEXT_TOKENS, 0, _FLUX.ffn, "Flux.1 1024^2 image-stream MLP down projection"),
        Shape("flux-ff-context-down", models.TEXT_TOKENS, 0, _FLUX.ffn, "Flux.1 text-stream MLP down projection"),
        Shape("wan14b-ffn-down", _WAN.tokens, 0, _WAN.ffn, "Wan2.1-14B 480p 81 frames, FFN down projection"),
        Shape("tiny", 37, 24, 200, "smoke test"),
    )
}
DEFAULT_SHAPES = ("flux-single-proj-out", "flux-ff-down", "flux-ff-context-down", "wan14b-ffn-down")


def settings(shape: Shape) -> list[tuple[str, dict]]:
    """``(label, launcher keyword arguments)``, the default first."""
    out = [("tile-8w-keep", {})]
    out += [(f"tile-{w}w-keep", dict(num_warps=w)) for w in (4, 16, 32)]
    out += [(f"tile-{w}w-recompute", dict(num_warps=w, recompute_activation=True)) for w in (4, 8, 16, 32)]
    out += [(f"chunked-{n}-{w}w", dict(max_tile=n, num_warps=w)) for n in (2048, 4096) for w in (4, 8)]
    return out


def run_shape(shape: Shape, dtype: torch.dtype, out_dtype: torch.dtype, seed: int) -> list[dict]:
    from omni_kernels.quant.activated_triton_kernel import launch_quantize_activated_triton as launch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape.rows, shape.width, device="cuda", generator=gen).to(dtype)
    x[:, :: max(1, shape.width // 3)] *= 20  # outlier channels
    head = torch.randn(shape.rows, shape.prefix, device="cuda", generator=gen).to(dtype) if shape.prefix else None
    nbytes = shape.rows * (shape.prefix + shape.width) * (x.element_size() + 1)
    rows = []
    baseline = None
    for label, options in settings(shape):
        def call(options=options):
            return launch(x, 0, 0.0, out_dtype, prefix=head, **options)
        try:
            q, scale = call()
            if baseline is None:
                baseline = (q, scale)
            same = torch.equal(scale, baseline[1]) and torch.equal(q.view(torch.uint8), baseline[0].view(torch.uint8))
            us = harness.median_us(call)
            rows.append(dict(shape=shape.name, setting=label, us=us, gbps=nbytes / us / 1e3,
                             same_as_default=same, status="ok" if same else "differs from the default"))
        except Exception as exc:  # a setting the compiler rejects (registers, say): record, go on
            rows.append(dict(shape=shape.name, setting=label, status=f"error: {type(exc).__name__}: {exc}"[:300]))
    from omni_kernels import has_compiled_extension

    if has_compiled_extension() and shape.prefix % 8 == 0 and shape.width % 8 == 0:
        def call_cuda():
            return torch.ops.omni_kernels.quantize_activated(x, head, 0, 0.0, out_dtype)
        q, scale = call_cuda()
        # The two kernels' GELUs may round apart: scales within 1e-5, codes equal in 99% of values.
        agree = bool(torch.allclose(scale, baseline[1], rtol=1e-5, atol=0)
                     and (q.float() != baseline[0].float()).float().mean() < 0.01)
        us = harness.median_us(call_cuda)
        rows.append(dict(shape=shape.name, setting="cuda", us=us, gbps=nbytes / us / 1e3, same_as_default=agree,
                         status="ok" if agree else "differs from the Triton kernel's (beyond one code in 1%)"))
    if head is not None:
        us = harness.median_us(lambda: launch(torch.cat([head, x], -1), shape.prefix, 0.0, out_dtype))
        rows.append(dict(shape=shape.name, setting="cat+kernel", us=us, gbps=None, same_as_default=None,
                         status="ok"))
    return rows


def markdown(env: dict, shapes: list[Shape], rows: list[dict], dtype: str) -> str:
    lines = ["# GELU-folded activation quantization: launch settings", "",
             f"- device: {env['device']}; torch {env['torch']} (CUDA {env['cuda']}), "
             f"triton {env['packages'].get('triton')}; input {dtype}, FP8 e4m3 output",
             f"- git commit: {env['git_commit']}; {env['utc']}",
             f"- command: `{env['command']}`",
             "- median us of triton.testing.do_bench (L2 flushed); GB/s over input read once + output written once;"
             " every setting's codes and scales are checked equal to the default's (tile-8w-keep).", ""]
    for shape in shapes:
        lines += [f"## {shape.name}: {shape.note}, {shape.rows} x ({shape.prefix} + {shape.width})", "",
                  "| setting | median us | GB/s | vs default | status |", "| --- | ---: | ---: | ---: | --- |"]
        mine = [r for r in rows if r["shape"] == shape.name]
        default = next((r.get("us") for r in mine if r["setting"] == "tile-8w-keep"), None)
        for r in mine:
            us = r.get("us")
            ratio = f"{default / us:.2f}x" if us and default else "-"
            lines.append(f"| {r['setting']} | {us:.1f} | {r['gbps'] or 0:.0f} | {ratio} | {r['status']} |"
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
    refusal = harness.gpu_refusal("bench/quant_activation_tune.py")
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    from omni_kernels.quant import fp8_unsupported_reason

    reason = fp8_unsupported_reason(torch.device("cuda"))
    if reason:
        print(f"FP8 output needs FP8 tensor cores: {reason}", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    env = harness.base_environment(("triton",))
    shapes = [SHAPES[name] for name in args.shapes]
    rows = []
    for shape in shapes:
        rows += run_shape(shape, dtype, torch.float8_e4m3fn, args.seed)
        torch.cuda.empty_cache()
    table = markdown(env, shapes, rows, args.dtype)
    harness.write_results(args.out_dir, "quant_activation_tune", env,
                  dict(environment=env, dtype=args.dtype, shapes=[vars(s) for s in shapes], results=rows), table)
    print(table)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
