#!/usr/bin/env python3
"""omni's per-token activation quantization kernels, CUDA C++ and Triton, side by side.

``torch.ops.omni_kernels.quantize_per_token`` (csrc/quant: one thread block per row, the row in
registers in 16-byte vectors) and ``torch.ops.omni_kernels.quantize_per_token_triton`` on the same
inputs in one process, plain and fused with LayerNorm + adaLN (the Flux/SD3 block input), at the
Flux and Wan2.1-14B linear-input shapes. The two are checked against each other (scales within
1e-5 relative, codes equal in at least 99% of the values: their float32 sums may round apart).

Beside the op (``triton``: its default launch), the Triton launcher's tuning options
(:func:`~omni_kernels.quant.triton_kernel.launch_quantize_per_token_triton`): ``triton-rR-wW``
quantizes R consecutive rows a program as one register tile, with W warps (``r1``: the one-row
kernel); ``triton-launcher`` is the default launch through the launcher (without the op's
dispatch, as the settings are called). A setting whose tile would give a thread more than ``--max-values-per-thread`` float32
values is skipped (it spills registers). Every setting is checked against the default launch:
``same`` (codes and scales bit-identical) is expected; with LayerNorm, where another warp count may
sum a row in another order, a setting within the cross-kernel tolerance above still passes, marked.

Median of ``triton.testing.do_bench`` (L2 flushed before each call), launched outside
``torch.library.wrap_triton``'s tracing path as the op's eager and Inductor-generated calls are;
GB/s over the bytes a kernel must move (input read once, 8-bit output written once).

    python3 bench/quant_per_token.py --out-dir bench/results
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
    cols: int
    note: str


_FLUX, _WAN = models.FLUX, models.WAN_720P
SHAPES = {
    s.name: s for s in (
        Shape("flux-3072", _FLUX.tokens, _FLUX.width, "Flux.1 1024^2: attention projections and MLP up input"),
        Shape("flux-12288", _FLUX.tokens, _FLUX.ffn, "Flux.1 1024^2: MLP down input"),
        Shape("flux-15360", _FLUX.tokens, models.FLUX_SINGLE_PROJ_OUT_IN, "Flux.1 1024^2: single blocks' proj_out input"),
        Shape("wan14b-5120", _WAN.tokens, _WAN.width, "Wan2.1-14B 720p 81 frames: attention projections"),
        Shape("wan14b-13824", _WAN.tokens, _WAN.ffn, "Wan2.1-14B 720p 81 frames: FFN down input"),
        Shape("tiny", 37, 200, "smoke test"),
    )
}
DEFAULT_SHAPES = ("flux-3072", "flux-12288", "flux-15360", "wan14b-5120", "wan14b-13824")


def triton_settings() -> list[tuple[str, dict]]:
    """``(label, launcher keyword arguments)`` of the Triton tuning settings timed beside the op."""
    out = [("triton-launcher", {}), ("triton-r1-w4", dict(num_warps=4))]
    out += [(f"triton-r{r}-w{w}", dict(rows_per_program=r, num_warps=w)) for r in (2, 4, 8, 16) for w in (4, 8)]
    return out


def values_per_thread(cols: int, options: dict) -> int:
    """float32 values of a ``[rows_per_program, BLOCK_K]`` tile each thread holds."""
    from omni_kernels.quant.triton_kernel import MAX_TILE, launch_config, multi_row_warps

    block, _, default_warps = launch_config(cols, MAX_TILE)
    rows = options.get("rows_per_program", 1)
    warps = options.get("num_warps") or (default_warps if rows == 1 else multi_row_warps(rows, block))
    return rows * block // (32 * warps)


def _agree_within_tolerance(q_a, s_a, q_b, s_b) -> bool:
    """Scales within 1e-5 relative, codes equal in at least 99% of the values."""
    return bool(torch.allclose(s_a, s_b, rtol=1e-5, atol=0) and (q_a.float() != q_b.float()).float().mean() < 0.01)


def compare_with_default(q, scale, q_default, scale_default, fused: bool) -> tuple[bool, str]:
    """``(same, status)`` of a setting's output against the default launch's."""
    same = torch.equal(scale, scale_default) and torch.equal(q.view(torch.uint8), q_default.view(torch.uint8))
    if same:
        return True, "ok"
    moved = (q.float() != q_default.float()).float().mean().item()
    scale_rel = ((scale - scale_default).abs() / scale_default).max().item()
    detail = f"{moved:.3%} of the codes differ, scales up to {scale_rel:.2e} relative"
    if fused and _agree_within_tolerance(q, scale, q_default, scale_default):
        return False, f"ok, not bit-identical (row sums in another order): {detail}"
    return False, f"differs from the default: {detail}"


def run_shape(shape: Shape, fused: bool, dtype: torch.dtype, seed: int, max_values_per_thread: int) -> list[dict]:
    from torch._library.triton import set_wrap_triton_enabled

    from omni_kernels.quant.triton_kernel import launch_quantize_per_token_triton

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

    def record(label, us, same, status):
        rows.append(dict(shape=shape.name, kind=kind, setting=label, us=us, gbps=nbytes / us / 1e3 if us else None,
                         same_as_default=same, status=status))

    with set_wrap_triton_enabled(False):  # launch as eager and Inductor-generated calls do
        q_t, s_t = torch.ops.omni_kernels.quantize_per_token_triton(*args)
        q_c, s_c = torch.ops.omni_kernels.quantize_per_token(*args)
        steps = (q_c.float() - q_t.float()).abs()
        agree = _agree_within_tolerance(q_c, s_c, q_t, s_t)
        for label, op in (("cuda", torch.ops.omni_kernels.quantize_per_token),
                          ("triton", torch.ops.omni_kernels.quantize_per_token_triton)):
            record(label, harness.median_us(lambda op=op: op(*args)), None if label == "cuda" else True,
                   "ok" if agree else f"cuda and triton differ (largest code difference {steps.max().item():.3g})")
        del q_c, s_c
        for label, options in triton_settings():
            values = values_per_thread(shape.cols, options)
            if values > max_values_per_thread:
                record(label, None, None, f"skipped: {values} values a thread > --max-values-per-thread "
                                          f"{max_values_per_thread}")
                continue
            try:
                def call(options=options):
                    return launch_quantize_per_token_triton(*args, **options)
                q, scale = call()
                same, status = compare_with_default(q, scale, q_t, s_t, fused)
                del q, scale
                record(label, harness.median_us(call), same, status)
            except Exception as exc:  # a setting the compiler rejects (resources, say): record, go on
                record(label, None, None, f"error: {type(exc).__name__}: {exc}"[:300])
    return rows


def markdown(env: dict, shapes: list[Shape], rows: list[dict], dtype: str) -> str:
    lines = ["# Per-token activation quantization: CUDA C++ vs Triton", "",
             f"- device: {env['device']}; torch {env['torch']} (CUDA {env['cuda']}), "
             f"triton {env['packages'].get('triton')}; input {dtype}, FP8 e4m3 output",
             f"- git commit: {env['git_commit']}; {env['utc']}",
             f"- command: `{env['command']}`",
             "- median us of triton.testing.do_bench (L2 flushed); GB/s over input read once + output written once;"
             " the two kernels' scales agree within 1e-5 and their codes in 99% of the values.",
             "- triton-rR-wW: the Triton launcher with R rows a program and W warps; `same`: codes and scales"
             " bit-identical to the default Triton launch (`triton`).", ""]
    for shape in shapes:
        for kind in ("plain", "layernorm+adaln"):
            mine = [r for r in rows if r["shape"] == shape.name and r["kind"] == kind]
            if not mine:
                continue
            lines += [f"## {shape.name} ({kind}): {shape.note}, {shape.rows} x {shape.cols}", "",
                      "| kernel | median us | GB/s | vs cuda | vs triton | same | status |",
                      "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
            baselines = [next((r.get("us") for r in mine if r["setting"] == name), None) for name in ("cuda", "triton")]
            for r in mine:
                us = r.get("us")
                ratios = " | ".join(f"{base / us:.2f}x" if us and base else "-" for base in baselines)
                same = {True: "yes", False: "no"}.get(r.get("same_as_default"), "-")
                lines.append(f"| {r['setting']} | {us:.1f} | {r['gbps']:.0f} | {ratios} | {same} | {r['status']} |"
                             if us else f"| {r['setting']} | - | - | - | - | {same} | {r['status']} |")
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(DEFAULT_SHAPES))
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-values-per-thread", type=int, default=256,
                        help="skip Triton settings whose tile gives a thread more float32 values than this")
    args = parser.parse_args(argv)
    refusal = harness.gpu_refusal("bench/quant_per_token.py")
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
    env = harness.base_environment(("triton",))
    shapes = [SHAPES[name] for name in args.shapes]
    rows = []
    for shape in shapes:
        for fused in (False, True):
            rows += run_shape(shape, fused, dtype, args.seed, args.max_values_per_thread)
        torch.cuda.empty_cache()
    table = markdown(env, shapes, rows, args.dtype)
    harness.write_results(args.out_dir, "quant_per_token", env,
                  dict(environment=env, dtype=args.dtype, shapes=[vars(s) for s in shapes], results=rows), table)
    print(table)
    return 0 if all(r["status"] == "ok" or r["status"].startswith(("ok,", "skipped")) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
