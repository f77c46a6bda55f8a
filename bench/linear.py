#!/usr/bin/env python3
"""Benchmark of omni's FP8/INT8 linear layers against bf16 ``nn.Linear``, and a Flux-shaped step.

Part 1, linear layers (one GPU), per shape ``M x K -> N`` of Flux.1 at 1024^2 (4608 tokens) and
Wan2.1-14B at 720p (75600 tokens), bf16 activations with outlier channels. Rows: ``bf16``
(``F.linear``, the baseline); ``omni-fp8``, :class:`QuantizedLinear` ``"fp8"`` as it comes
(backend ``auto``: on Hopper omni's tuned cuBLASLt GEMM; eager, one C++ op quantizes and
multiplies), and its forms ``-aten``, ``-triton``, ``-triton-quant``, ``-two-calls`` (the two
Python calls), ``-precise`` / ``-fast`` (accumulation forced); ``omni-int8`` (Triton GEMM) and
``-aten`` (``torch._int_mm``); weight-only ``omni-{fp8,int8}-wo-{aten,triton,triton_gemv}`` (the
GEMV for ``M <= 16``); the peer ``torchao-fp8-dynamic`` (per-row, when torchao imports);
``quant-*`` and ``gemm-fp8-*``, the activation quantization and the FP8 GEMM alone (where the
W8A8 time goes; the cuBLASLt plans are listed under the tables); ``bf16+gelu`` /
``omni-fp8+gelu`` at the MLP down projections, the GELU and the layer as the model runs them.
``--shapes flux-adaln`` (opt-in) times Flux's adaLN modulation linears at one row a sample,
bound by the weight read: their tables give its bandwidth instead of TFLOP/s.

Every W8A8 time includes the activation quantization. Times are medians over ``--rounds``
rounds (each times every variant once, in turn) of ``triton.testing.do_bench`` medians (L2
flushed); ``rel err`` is against a float32 GEMM of the unquantized operands on 2048 rows.

Part 2 (``linear_step.py``): one Flux.1-shaped transformer step (random bf16 weights, 4096
image + 512 text tokens): bf16 eager, FP8 eager (also with the fused QK-norm + RoPE processor,
and with ``aten`` GEMMs), FP8 compiled, INT8 eager; the embedders, ``norm_out`` and
``proj_out`` stay bf16. Median step time (CUDA events), relative L2 error against bf16, memory.

Record: ``<out-dir>/linear_<device>_<YYYYMMDD>.json`` and ``.md`` (the markdown printed last).
The step runs first; ``--budget-s`` stops the optional measurements and ``--hard-budget-s``
every one, so a run fits a device call; what was skipped is recorded.

    python3 bench/linear.py [--shapes flux wan] [--skip-transformer] [--out-dir DIR]
    python3 bench/linear.py --shapes flux-adaln --skip-transformer   # the modulation GEMVs alone
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

if __package__:  # imported as bench.<script> (the tests)
    from bench import harness, linear_step
    from bench import shapes as models
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import harness
    import linear_step
    import shapes as models



@dataclass(frozen=True)
class LinearShape:
    name: str
    model: str
    m: int
    k: int
    n: int
    # The layer's input is a GELU's output in the model (an MLP's down projection): the
    # "+gelu" rows time the layer with that GELU, as the model runs it.
    after_gelu: bool = False


def _transformer_linears(prefix: str, note: str, model: models.Model, mlp: str) -> list[LinearShape]:
    """The attention projections, the MLP up and the MLP down (after a GELU) of ``model``."""
    m, width, ffn = model.tokens, model.width, model.ffn
    return [
        LinearShape(f"{prefix}-{width}x{width}", f"{note} (attention projections)", m, width, width),
        LinearShape(f"{prefix}-{width}x{ffn}", f"{note} ({mlp} up)", m, width, ffn),
        LinearShape(f"{prefix}-{ffn}x{width}", f"{note} ({mlp} down)", m, ffn, width, after_gelu=True),
    ]


SHAPES = {
    "flux": _transformer_linears("flux", "Flux.1 1024^2", models.FLUX, "MLP"),
    "wan": _transformer_linears("wan14b", "Wan2.1-14B 720p 81f", models.WAN_720P, "FFN"),
    # Opt-in (not in DEFAULT_SHAPE_GROUPS): one row per sample, a GEMV bound by the weight read.
    "flux-adaln": [
        LinearShape(f"flux-adaln-{kind}-M{m}", f"Flux.1 adaLN modulation ({where}), batch {m}", m,
                    models.FLUX.width, models.FLUX_ADALN[kind])
        for kind, where in (
            ("double", "transformer_blocks.*.norm1(_context).linear"),
            ("single", "single_transformer_blocks.*.norm.linear"),
        )
        for m in (1, 2)
    ],
}
# What a run without --shapes measures (the groups before the opt-in ones were added).
DEFAULT_SHAPE_GROUPS = ("flux", "wan")

# The comparison first (bf16, omni FP8, omni INT8, torchao), then the rows that say where
# the time goes and which backend "auto" should prefer.
ESSENTIAL = ("bf16", "omni-fp8", "omni-int8", "torchao-fp8-dynamic")
VARIANTS = ESSENTIAL + (
    "omni-fp8-aten", "quant-cuda", "quant-triton", "gemm-fp8-aten", "gemm-fp8-cublaslt", "omni-int8-aten", "omni-fp8-triton", "omni-fp8-triton-quant",
    "omni-fp8-two-calls",
    "omni-fp8-precise", "omni-fp8-fast", "omni-fp8-wo-aten", "omni-fp8-wo-triton", "omni-int8-wo-aten",
    "omni-int8-wo-triton", "omni-fp8-wo-triton_gemv", "omni-int8-wo-triton_gemv",
    "bf16+gelu", "omni-fp8+gelu",
)
# At the layers whose input is a GELU's output: the GELU (tanh) and the layer together, bf16
# (F.gelu, then F.linear) against omni FP8 with the GELU fused into the activation
# quantization (quantize_activated_per_token, then the FP8 GEMM): what the model runs. The
# "+gelu" rows' speedup is against "bf16+gelu"; the figure stays the plain rows'.
_GELU_VARIANTS = {"bf16+gelu", "omni-fp8+gelu"}
# Weight-only layers are for memory-bound (small-M) cases; at Wan's M they only cost time.
_WAN_SKIPS = {"omni-fp8-wo-triton", "omni-int8-wo-triton", "omni-fp8-precise", "omni-fp8-fast", "omni-fp8-two-calls"}
ERROR_ROWS = 2048
DEVICE = "cuda"
# The GEMV takes at most this many rows (omni_kernels.quant.GEMV_MAX_M).
GEMV_MAX_M = 16
_GEMV_VARIANTS = {"omni-fp8-wo-triton_gemv", "omni-int8-wo-triton_gemv"}
# At the modulation shapes: bf16, the weight-only layers, and the W8A8 layers for reference
# (the activation-quantization-only and torchao rows say nothing about a GEMV).
_ADALN_VARIANTS = {"bf16", "omni-fp8", "omni-int8"} | {v for v in VARIANTS if "-wo-" in v}


def _variants_for(group: str, shape: LinearShape, variants) -> list[str]:
    """The variants of ``variants`` that make sense at ``shape`` of ``group``."""
    chosen = [v for v in variants if not (group == "wan" and v in _WAN_SKIPS)]
    if group == "flux-adaln":
        chosen = [v for v in chosen if v in _ADALN_VARIANTS]
    if shape.m > GEMV_MAX_M:
        chosen = [v for v in chosen if v not in _GEMV_VARIANTS]
    if not shape.after_gelu:
        chosen = [v for v in chosen if v not in _GELU_VARIANTS]
    return chosen


def _weight_bytes(variant: str, shape: LinearShape) -> int | None:
    """Bytes of the weight a layer variant reads (8-bit + float32 scales, or bf16); None otherwise."""
    if variant in ("bf16", "bf16+gelu"):
        return 2 * shape.n * shape.k
    if variant.startswith("omni-") or variant == "torchao-fp8-dynamic":
        return shape.n * shape.k + 4 * shape.n
    return None


class _Unavailable(Exception):
    pass


class _Budget:
    """Soft limit: no optional measurement starts after it; hard limit: nothing starts."""

    def __init__(self, soft_s: float, hard_s: float) -> None:
        self.start = time.monotonic()
        self.soft_s = soft_s
        self.hard_s = hard_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def exceeded(self, essential: bool = False) -> bool:
        return self.elapsed() > (self.hard_s if essential else self.soft_s)


def _bench(fn) -> float:
    """Median microseconds of ``fn`` (the timer the CPU tests replace)."""
    return harness.median_us(fn, warmup=10, rep=100)


def _activations(m, k, gen):
    x = torch.randn(m, k, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    channels = torch.randperm(k, device=DEVICE, generator=gen)[:4]
    x[:, channels] *= 20.0
    return x


def _torchao_layer(linear: nn.Linear) -> nn.Module:
    try:
        import torchao.quantization as tq
    except Exception as exc:  # ImportError, or a wheel built for another torch
        raise _Unavailable(f"torchao does not import: {type(exc).__name__}: {exc}".splitlines()[0][:300])
    config_cls = getattr(tq, "Float8DynamicActivationFloat8WeightConfig", None)
    if config_cls is None:
        raise _Unavailable("torchao has no Float8DynamicActivationFloat8WeightConfig")
    wrapper = nn.Sequential(copy.deepcopy(linear))
    tq.quantize_(wrapper, config_cls(granularity=tq.PerRow()))
    return wrapper


def _run_linear_shape(shape: LinearShape, variants, seed: int, budget: _Budget, rounds: int = 1):
    from omni_kernels.quant import QuantizedLinear, quantize_per_token, scaled_mm
    from omni_kernels.quant.activated import quantize_activated_per_token

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = _activations(shape.m, shape.k, gen)
    torch.manual_seed(seed)
    linear = nn.Linear(shape.k, shape.n, device=DEVICE, dtype=torch.bfloat16).eval()
    flops = 2.0 * shape.m * shape.k * shape.n
    with torch.no_grad():
        ref = x[:ERROR_ROWS].float() @ linear.weight.float().t() + linear.bias.float()
        # the "+gelu" rows take x as the GELU's input
        ref_gelu = (F.gelu(x[:ERROR_ROWS].float(), approximate="tanh") @ linear.weight.float().t()
                    + linear.bias.float()) if shape.after_gelu else None

    layers: dict[str, nn.Module] = {}

    def omni(method, backend, **options):
        key = (method, backend, tuple(sorted(options.items())))
        if key not in layers:
            layers[key] = QuantizedLinear.from_linear(linear, method, backend=backend, **options)
        return layers[key]

    def make(variant):
        if variant == "bf16":
            return lambda: F.linear(x, linear.weight, linear.bias), True
        if variant == "bf16+gelu":
            return lambda: F.linear(F.gelu(x, approximate="tanh"), linear.weight, linear.bias), True
        if variant == "omni-fp8+gelu":
            layer = omni("fp8", "auto")
            return (lambda: scaled_mm(*quantize_activated_per_token(x, "fp8"), layer.qweight, layer.weight_scale,
                                      layer.bias, torch.bfloat16)), True
        if variant == "omni-fp8":
            return omni("fp8", "auto"), True
        if variant == "omni-fp8-aten":
            return omni("fp8", "aten"), True
        if variant == "omni-fp8-precise":
            return omni("fp8", "auto", fast_accum=False), True
        if variant == "omni-fp8-fast":
            return omni("fp8", "auto", fast_accum=True), True
        if variant == "omni-fp8-triton":
            return omni("fp8", "triton"), True
        if variant == "omni-fp8-two-calls":
            layer = omni("fp8", "auto")
            return (lambda: scaled_mm(*quantize_per_token(x, "fp8"), layer.qweight, layer.weight_scale,
                                      layer.bias, torch.bfloat16)), True
        if variant == "omni-fp8-triton-quant":
            return omni("fp8", "auto", activation_backend="triton"), True
        if variant == "omni-int8":
            return omni("int8", "triton"), True
        if variant == "omni-int8-aten":
            return omni("int8", "aten"), True
        if variant.startswith("omni-") and "-wo-" in variant:
            dtype, backend = variant[len("omni-"):].split("-wo-")
            return omni(f"{dtype}_weight_only", backend), True
        if variant == "torchao-fp8-dynamic":
            return _torchao_layer(linear), True
        if variant.startswith("quant-"):
            backend = variant[len("quant-"):]
            return (lambda: quantize_per_token(x, "fp8", backend=backend)), False
        if variant.startswith("gemm-fp8-"):
            backend = variant[len("gemm-fp8-"):]
            layer = omni("fp8", backend)
            x_q, x_scale = quantize_per_token(x, "fp8")
            return (lambda: scaled_mm(x_q, x_scale, layer.qweight, layer.weight_scale, layer.bias,
                                      torch.bfloat16, backend=backend)), False
        raise ValueError(variant)

    rows = []
    timed_calls = []  # (row, call, is_layer) of the variants that ran, for the later rounds
    for variant in variants:
        row = dict(shape=shape.name, model=shape.model, m=shape.m, k=shape.k, n=shape.n, variant=variant)
        if budget.exceeded(essential=variant in ESSENTIAL):
            row["status"] = "skipped: time budget"
            rows.append(row)
            continue
        try:
            fn, is_layer = make(variant)
            # (fn bound now: the later rounds call these after the loop has rebound the name)
            call = functools.partial(fn, x) if isinstance(fn, nn.Module) else fn
            with torch.no_grad():
                out = call()  # warm-up: autotuning, compilation
                torch.cuda.synchronize()
                if is_layer:
                    row["rel_err"] = linear_step.relative_error(
                        out[:ERROR_ROWS], ref_gelu if variant in _GELU_VARIANTS else ref)
                del out
                row["round_medians_us"] = [_bench(call)]
                # do_bench's figure includes host time when a call's launches outlast its kernels
                # (a shared machine's slow host): the padded GPU time separates the two.
                row["host_us"] = harness.host_us(call)
                row["padded_us"] = harness.padded_us(call, row["host_us"])
            row["status"] = "ok"
            timed_calls.append((row, call, is_layer))
        except _Unavailable as exc:
            row["status"] = f"unavailable: {exc}"
        except Exception as exc:
            row["status"] = f"error: {type(exc).__name__}: {exc}".splitlines()[0][:400]
            row["traceback"] = traceback.format_exc()[-3000:]
            print(f"[{shape.name}] {variant} failed:\n{row['traceback']}", file=sys.stderr)
        rows.append(row)
        if row.get("status") != "ok":
            print(f"[{shape.name}] {variant}: {row['status']}", flush=True)
    # Later rounds time every variant again, in turn: a slow spell of the GPU or the host (clocks,
    # a neighbour's job) then lands on all variants alike instead of on whichever ran during it,
    # and the figure is the median of the rounds' medians.
    for _ in range(rounds - 1):
        if budget.exceeded(essential=False):
            break
        with torch.no_grad():
            for row, call, _ in timed_calls:
                row["round_medians_us"].append(_bench(call))
    baselines = {}  # "bf16" / "bf16+gelu": (median us, padded us)
    for row, _, is_layer in timed_calls:
        row["median_us"] = statistics.median(row["round_medians_us"])
        row["tflops"] = flops / (row["median_us"] * 1e-6) / 1e12 if is_layer else None
        weight_bytes = _weight_bytes(row["variant"], shape) if is_layer else None
        if weight_bytes is not None:
            row["weight_gbps"] = weight_bytes / (row["median_us"] * 1e-6) / 1e9
        if row["variant"] in ("bf16", "bf16+gelu"):
            baselines[row["variant"]] = (row["median_us"], row.get("padded_us"))
        err = f", rel err {row['rel_err']:.2e}" if "rel_err" in row else ""
        spread = ", ".join(f"{t:.1f}" for t in row["round_medians_us"])
        print(f"[{shape.name}] {row['variant']}: {row['median_us']:.1f} us (rounds: {spread}){err}", flush=True)
    for row in rows:
        baseline_us, baseline_padded_us = baselines.get(
            "bf16+gelu" if row["variant"] in _GELU_VARIANTS else "bf16", (None, None))
        if row.get("status") == "ok" and baseline_us and row.get("tflops") is not None:
            row["speedup_vs_bf16"] = baseline_us / row["median_us"]
            if baseline_padded_us and row.get("padded_us"):
                row["padded_speedup_vs_bf16"] = baseline_padded_us / row["padded_us"]
    layers.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- reporting


def _markdown(env, linear_rows, step_rows) -> str:
    lines = [
        "# FP8 / INT8 linear layers",
        "",
        *harness.provenance_lines(env, f"triton {env['packages'].get('triton')}, diffusers "
                                  f"{env['packages'].get('diffusers')}, torchao {env['packages'].get('torchao')}"),
        "- median us: the median over rounds (every variant of a shape timed once per round, in turn) "
        "of triton.testing.do_bench medians (L2 flushed); W8A8 times include the per-token "
        "activation quantization; rel err vs a float32 GEMM of the unquantized operands "
        f"(first {ERROR_ROWS} rows); bf16 activations with 4 outlier channels (x20). host us: CPU "
        "time a call; padded us: GPU time with a sleep covering the launch (no host time: where "
        "the median is above it, the host was the bottleneck). Rows ending +gelu (down projections): "
        "the GELU before the layer included, speedups against bf16+gelu.",
        "",
    ]
    for shape in dict.fromkeys(r["shape"] for r in linear_rows):
        first = next(r for r in linear_rows if r["shape"] == shape)
        # A GEMV's measure is the weight's read bandwidth, not TFLOP/s.
        gemv = first["m"] <= GEMV_MAX_M
        lines += [
            f"## {shape}: {first['model']}, M={first['m']}, K={first['k']}, N={first['n']}",
            "",
            f"| variant | median us | {'weight GB/s' if gemv else 'TFLOP/s'} | speedup vs bf16 | rel err "
            "| host us | padded us | padded speedup | status |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in linear_rows:
            if r["shape"] != shape:
                continue
            if r.get("status") == "ok":
                if gemv:
                    tflops = f"{r['weight_gbps']:.0f}" if r.get("weight_gbps") else "-"
                else:
                    tflops = f"{r['tflops']:.0f}" if r.get("tflops") else "-"
                speed = f"{r['speedup_vs_bf16']:.2f}x" if r.get("speedup_vs_bf16") else "-"
                err = f"{r['rel_err']:.2e}" if "rel_err" in r else "-"
                host = f"{r['host_us']:.0f}" if r.get("host_us") is not None else "-"
                padded = f"{r['padded_us']:.1f}" if r.get("padded_us") is not None else "-"
                padded_speed = f"{r['padded_speedup_vs_bf16']:.2f}x" if r.get("padded_speedup_vs_bf16") else "-"
                lines.append(f"| {r['variant']} | {r['median_us']:.1f} | {tflops} | {speed} | {err} | {host} "
                             f"| {padded} | {padded_speed} | ok |")
            else:
                lines.append(f"| {r['variant']} | - | - | - | - | - | - | - | {str(r.get('status')).replace('|', '/')} |")
        lines.append("")
    if step_rows:
        lines += [
            "## Flux-shaped transformer step (Flux.1 config, 11.9B random bf16 weights, 1024^2: "
            "4096 image + 512 text tokens)",
            "",
            f"Kept in bf16: {', '.join(linear_step.FLUX_SKIP)}. Median step time (CUDA events).",
            "",
            "| variant | step ms | speedup vs bf16 eager | rel err vs bf16 | model GiB | memory vs bf16 "
            "| peak GiB | status |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in step_rows:
            if r.get("status") == "ok":
                speed = f"{r['speedup_vs_bf16_eager']:.2f}x" if "speedup_vs_bf16_eager" in r else "1.00x"
                err = f"{r['rel_err_vs_bf16']:.4f}" if "rel_err_vs_bf16" in r else "-"
                mem = f"{r['memory_vs_bf16']:.1%}" if "memory_vs_bf16" in r else "100%"
                status = "ok" + (f" ({r['compile']}, {r['compile_s']:.0f} s)" if "compile" in r else "")
                lines.append(
                    f"| {r['variant']} | {r['step_ms']:.1f} | {speed} | {err} | {r['model_gib']:.2f} | "
                    f"{mem} | {r['peak_gib']:.1f} | {status.replace('|', '/')} |"
                )
            else:
                lines.append(f"| {r['variant']} | - | - | - | - | - | - | {str(r.get('status')).replace('|', '/')} |")
        lines.append("")
    if env.get("cublaslt_plans"):
        lines += ["## cuBLASLt FP8 GEMM plans (omni's `cublaslt` backend)", ""]
        lines += [f"- {plan}" for plan in env["cublaslt_plans"]]
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(DEFAULT_SHAPE_GROUPS),
                        help=f"shape groups (default: {' '.join(DEFAULT_SHAPE_GROUPS)}; 'flux-adaln' is opt-in)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="linear-layer variants (bf16 is the baseline and always runs first)")
    parser.add_argument("--step-variants", nargs="+", choices=linear_step.STEP_VARIANTS,
                        default=list(linear_step.STEP_VARIANTS))
    parser.add_argument("--skip-transformer", action="store_true", help="linear layers only")
    parser.add_argument("--steps", type=int, default=5, help="timed transformer steps per variant")
    parser.add_argument("--budget-s", type=float, default=210.0,
                        help="start no optional measurement after this many seconds")
    parser.add_argument("--hard-budget-s", type=float, default=270.0,
                        help="start no measurement at all after this many seconds")
    harness.add_out_dir_argument(parser, __file__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3,
                        help="time every variant of a shape this many times, in turn; report the median")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1; got {args.rounds}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if harness.refuse_without_gpu("bench/linear.py"):
        return 2
    budget = _Budget(args.budget_s, args.hard_budget_s)
    env = harness.base_environment(("triton", "diffusers", "torchao"))
    capability = torch.cuda.get_device_capability()
    variants = ["bf16"] + [v for v in args.variants if v != "bf16"]
    if capability < (8, 9):
        print(f"note: capability {capability} has no FP8; FP8 variants will report why", file=sys.stderr)

    step_rows = []
    if not args.skip_transformer:
        try:
            step_rows = linear_step.run_transformer(budget, args.steps, list(args.step_variants))
        except Exception as exc:
            step_rows = [dict(variant="all", status=f"error: {type(exc).__name__}: {exc}".splitlines()[0][:400],
                              traceback=traceback.format_exc()[-3000:])]
            print(step_rows[0]["traceback"], file=sys.stderr)
    linear_rows = []
    for group in args.shapes:
        for shape in SHAPES[group]:
            chosen = _variants_for(group, shape, variants)
            try:
                linear_rows += _run_linear_shape(shape, chosen, args.seed, budget, args.rounds)
            except Exception as exc:  # inputs did not fit, say: record and go on
                linear_rows.append(dict(shape=shape.name, model=shape.model, m=shape.m, k=shape.k,
                                        n=shape.n, variant="all",
                                        status=f"error: {type(exc).__name__}: {exc}".splitlines()[0][:400]))
                print(traceback.format_exc(), file=sys.stderr)
                torch.cuda.empty_cache()

    env["elapsed_s"] = budget.elapsed()
    from omni_kernels.quant import fp8_gemm_plans

    env["cublaslt_plans"] = fp8_gemm_plans()

    table = _markdown(env, linear_rows, step_rows)
    harness.write_results(args.out_dir, "linear", env,
                          dict(environment=env, linear=linear_rows, transformer_step=step_rows), table)
    print(table)
    ok = all(
        r.get("status") == "ok" or str(r.get("status", "")).startswith(("unavailable", "skipped"))
        for r in linear_rows + step_rows
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
