#!/usr/bin/env python3
"""Per-step time of full-size diffusion transformers under omni's acceleration stacks (one GPU).

Models (random bf16 weights at full width, built on the GPU; the transformer only, synthetic
inputs of the real shapes; the modules diffusers keeps in float32 stay float32): ``flux``,
FLUX.1-dev-shaped (19 + 38 blocks) at 1024x1024, 4096 image + 512 text tokens, one forward a
step; ``wan``, Wan2.1-T2V-14B-shaped (40 blocks) at 480x832 and 81 frames (32,760 tokens), two
forwards a step (classifier-free guidance).

Variants (``VARIANT_LABELS``), each applied to the same model and undone before the next: the
peers (a) diffusers eager and (b) diffusers ``compile_repeated_blocks``; (c) omni's attention
(its auto choice and fused QK-norm + RoPE processor) + regional compile; (d0) (c) + FP8 linears,
q/k/v not fused; (d) (c) + ``quant="fp8"`` with its defaults (q/k/v triples fused, MLP GELUs
folded into the quantization, LayerNorm + adaLN outputs quantized once where the adapter
declares the blocks, the other activation quantizations left to Inductor); (e) (d) + omni's
quantized attention, skipped with the reason where it cannot run; (f) (d) + the peer
SageAttention 1.0.6. The ablations of (d) (d1-d9, e1, g) run only when ``--variants`` names them.

Per variant: the first call (with compilation), the median and min forward time over
``--iters`` calls after ``--warmup`` (CUDA events), the step time with each forward
synchronized and with forwards back to back as a denoising loop runs them, the speedup over
(a), the output's relative error against (a), and the peak GPU memory; then the targets of
issue 6 (Flux step <= 90 ms for (d), Wan >= 1.5x (a) for (e)). Random weights say nothing
about image quality.

Record: ``<out-dir>/pipeline_<device>_<YYYYMMDD>.json`` and ``.md`` (``pipeline-<models>_...``
when only some models run) with the commit, device, versions and command; the markdown is
printed last. ``$OMNI_PIPELINE_MODELS`` sets the default of ``--models``.

    python3 bench/pipeline.py [--models flux wan] [--variants eager omni_fp8 ...] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

if __package__:  # imported as bench.<script> (the tests)
    from bench import harness
    from bench.pipeline_models import MODELS, SMOKE_MODELS, ModelSpec, build_transformer, forward_once, make_inputs
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import harness
    from pipeline_models import MODELS, SMOKE_MODELS, ModelSpec, build_transformer, forward_once, make_inputs


VARIANTS = ("eager", "diffusers_compile", "omni_lossless", "omni_fp8_unfused", "omni_fp8", "omni_fp8_kernel_quant",
            "omni_fp8_split_quant", "omni_fp8_unfolded", "omni_fp8_cuda_graphs", "omni_fp8_diffusers_norm_rope",
            "omni_fp8_sage", "fp8_sageattention", "omni_fp8_eager", "omni_fp8_unfused_norms",
            "omni_fp8_int8_modulation", "omni_fp8_int8_modulation_cuda_graphs", "omni_fp8_sage_sm90")
# Activation-quantization and launch experiments, run only when --variants names them.
_OPT_IN_VARIANTS = ("omni_fp8_kernel_quant", "omni_fp8_split_quant", "omni_fp8_unfolded", "omni_fp8_cuda_graphs",
                    "omni_fp8_diffusers_norm_rope", "omni_fp8_eager", "omni_fp8_unfused_norms",
                    "omni_fp8_int8_modulation", "omni_fp8_int8_modulation_cuda_graphs", "omni_fp8_sage_sm90")
#: run unless --variants names others (each compiled variant costs minutes of compilation)
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v not in _OPT_IN_VARIANTS)
# Quantized-attention variants: the attention backend each one names.
_QUANTIZED_ATTENTION = {"omni_fp8_sage": "omni_sage", "fp8_sageattention": "sageattention",
                        "omni_fp8_sage_sm90": "omni_sage_sm90"}
VARIANT_LABELS = {
    "eager": "(a) diffusers eager",
    "diffusers_compile": "(b) diffusers compile_repeated_blocks",
    "omni_lossless": "(c) omni attention + regional compile",
    "omni_fp8_unfused": "(d0) (c) + FP8 linears, q/k/v not fused",
    "omni_fp8": "(d) (c) + FP8 linears",
    "omni_fp8_kernel_quant": "(d1) (d), activation quantization as omni's kernel op",
    "omni_fp8_split_quant": "(d2) (d), activation quantization as omni's kernel op for K > 8192 only",
    "omni_fp8_unfolded": "(d3) (d), MLP GELUs not folded into the quantization",
    "omni_fp8_cuda_graphs": "(d4) (d) + CUDA graphs",
    "omni_fp8_diffusers_norm_rope": "(d5) (d), diffusers' QK norm + RoPE instead of omni's fused kernel",
    "omni_fp8_sage": "(e) (d) + omni quantized attention (omni_sage)",
    "fp8_sageattention": "(f) (d) + sageattention 1.0.6 (peer)",
    "omni_fp8_eager": "(g) (d) without compile (eager omni stack)",
    "omni_fp8_unfused_norms": "(d7) (d), each layer quantizing its LayerNorm + adaLN input itself (fuse_norms=False)",
    "omni_fp8_int8_modulation": "(d8) (d), adaLN modulation linears INT8 weight-only (Triton GEMV) instead of bf16",
    "omni_fp8_int8_modulation_cuda_graphs": "(d9) (d8) + CUDA graphs",
    "omni_fp8_sage_sm90": "(e1) (e) with the Hopper CUDA quantized attention kernel (omni_sage_sm90)",
}


class Skip(Exception):
    """A variant that cannot run here; the message says why."""


# --------------------------------------------------------------------------- variants


def _omni_config(**fields):
    from omni_diffusion import AccelConfig

    return AccelConfig(**fields)


def _check_fp8(device: torch.device) -> None:
    try:
        import omni_diffusion.quantization  # noqa: F401
        from omni_kernels.quant import fp8_unsupported_reason
    except ImportError as exc:
        raise Skip(f"omni_diffusion.quantization is not available: {exc}") from exc
    reason = fp8_unsupported_reason(device)
    if reason:
        raise Skip(f"FP8 linears cannot run here: {reason}")


def _kernel_activation_backend(device: torch.device) -> str:
    """omni's activation-quantization kernel that takes Flux's bf16 linear inputs here."""
    if device.type != "cuda":
        raise Skip("omni's activation-quantization kernels need a GPU")
    from omni_kernels.quant import supported_backends

    reasons = supported_backends(torch.empty(4608, 3072, device=device, dtype=torch.bfloat16), "fp8")
    for backend in ("cuda", "triton"):
        if reasons[backend] is None:
            return backend
    raise Skip(f"no activation-quantization kernel: {reasons}")


def apply_variant(variant: str, model, device: torch.device, args,
                  spec: ModelSpec | None = None) -> Callable[[], None]:
    """Apply ``variant`` to ``model``; returns its undo. Raises :class:`Skip`."""
    import omni_diffusion as od

    if variant in ("omni_fp8_int8_modulation", "omni_fp8_int8_modulation_cuda_graphs"):
        base = "omni_fp8" if variant == "omni_fp8_int8_modulation" else "omni_fp8_cuda_graphs"
        return _with_weight_only_modulation(model, spec, lambda: apply_variant(base, model, device, args))

    if variant == "eager":
        return lambda: None
    if variant == "diffusers_compile":
        targets = [m for m in model.modules() if type(m).__name__ in (model._repeated_blocks or ())]
        model.compile_repeated_blocks(fullgraph=True, backend=args.compile_backend)

        def undo() -> None:
            for module in targets:
                module._compiled_call_impl = None

        return undo
    common: dict[str, Any] = dict(compile=True, compile_backend=args.compile_backend)
    quant = dict(quant="fp8")
    if device.type == "cpu":  # smoke test: torch's CPU ops, not Triton's interpreter
        quant["quant_options"] = {"activation_backend": "torch"}
    if variant == "omni_lossless":
        config = _omni_config(attention="auto", **common)
    elif variant == "omni_fp8_eager":
        _check_fp8(device)
        config = _omni_config(attention="auto", **quant)
    elif variant in ("omni_fp8", "omni_fp8_unfused", *_OPT_IN_VARIANTS):
        _check_fp8(device)
        options = dict(quant.pop("quant_options", {}))
        if variant == "omni_fp8_unfused":
            options["fuse_projections"] = False
        if variant == "omni_fp8_kernel_quant":
            options["activation_backend"] = _kernel_activation_backend(device)
        if variant == "omni_fp8_split_quant":
            _kernel_activation_backend(device)  # the wide layers need a kernel: Skip without one
            options["activation_backend"] = "split"  # split_k: the default, 8192
        if variant == "omni_fp8_unfolded":
            options["fuse_activations"] = False
        if variant == "omni_fp8_unfused_norms":
            options["fuse_norms"] = False
        graphs = {}
        if variant == "omni_fp8_diffusers_norm_rope":
            graphs["fused_norm_rope"] = False
        if variant == "omni_fp8_cuda_graphs":
            if device.type != "cuda":
                raise Skip("CUDA graphs need a CUDA device")
            graphs["cuda_graphs"] = True
        config = _omni_config(attention="auto", quant_options=options, **quant, **common, **graphs)
    elif variant in _QUANTIZED_ATTENTION:
        _check_fp8(device)
        from omni_kernels.attention import get_backend

        backend = _QUANTIZED_ATTENTION[variant]
        reason = get_backend(backend).unavailable_reason(device)
        if reason is not None:
            raise Skip(f"{backend}: {reason}")
        config = _omni_config(attention=backend, **quant, **common)
    else:
        raise ValueError(variant)
    od.accelerate(model, config)
    return lambda: od.undo(model)


def _with_weight_only_modulation(model, spec: ModelSpec | None, apply: Callable[[], Callable[[], None]]):
    """Run ``apply`` with the model's adapter giving ``spec.modulation_linears`` INT8 weight-only
    (its ``quant_weight_only`` hook) instead of keeping them bf16 (``quant_skip``); the adapter
    class is put back before this returns (the layers stay as quantized until the undo)."""
    from omni_diffusion.adapters import adapter_for_transformer

    if spec is None or not spec.modulation_linears:
        raise Skip("the model spec names no modulation linears")
    adapter_cls = type(adapter_for_transformer(model))
    saved = adapter_cls.__dict__.get("quant_skip"), adapter_cls.__dict__.get("quant_weight_only")
    missing = [p for p in spec.modulation_linears if p not in adapter_cls.quant_skip]
    if missing:
        raise Skip(f"{adapter_cls.__name__}.quant_skip no longer lists {missing}")
    adapter_cls.quant_skip = tuple(p for p in adapter_cls.quant_skip if p not in spec.modulation_linears)
    adapter_cls.quant_weight_only = (*adapter_cls.quant_weight_only, *spec.modulation_linears)
    try:
        return apply()
    finally:
        for name, value in zip(("quant_skip", "quant_weight_only"), saved, strict=True):
            if value is None:
                delattr(adapter_cls, name)
            else:
                setattr(adapter_cls, name, value)


def auto_attention_choice(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> dict:
    """Which backend omni's "auto" takes for the model's attention (diffusers' bshd layout)."""
    from omni_kernels.attention import select_backend

    b, h, sq, skv, d = spec.attention
    q = torch.empty(b, sq, h, d, device=device, dtype=dtype)
    k = torch.empty(b, skv, h, d, device=device, dtype=dtype)
    name, reason = select_backend(q, k, k, layout="bshd")
    return dict(backend=name, reason=reason)


# --------------------------------------------------------------------------- timing


def time_variant(model, inputs, warmup: int, iters: int, device: torch.device) -> tuple[dict, torch.Tensor]:
    harness.synchronize(device)
    start = time.perf_counter()
    out = forward_once(model, inputs)
    harness.synchronize(device)
    first_s = time.perf_counter() - start
    for _ in range(warmup):
        forward_once(model, inputs)
    times = harness.call_times_ms(lambda: forward_once(model, inputs), iters, device)
    # A denoising loop launches step n+1 while step n still runs on the GPU; the per-call figure
    # above waits for each forward and so also counts the host's launch latency once a forward.
    loop_ms = harness.loop_ms(lambda: forward_once(model, inputs), iters, device)
    return dict(first_call_s=round(first_s, 2), forward_ms=statistics.median(times),
                forward_min_ms=min(times), forward_all_ms=[round(t, 3) for t in times],
                loop_forward_ms=loop_ms), out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run_model(spec: ModelSpec, variants: list[str], device, dtype, args) -> tuple[list[dict], dict]:
    warmup = args.warmup if args.warmup is not None else spec.warmup
    iters = args.iters if args.iters is not None else spec.iters
    started = time.perf_counter()
    model = build_transformer(spec, device, dtype)
    inputs = make_inputs(spec, device, dtype)
    info = dict(
        model=spec.name, description=spec.description, transformer=spec.cls_name,
        params_billion=round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        build_s=round(time.perf_counter() - started, 1), warmup=warmup, iters=iters,
        forwards_per_step=spec.forwards_per_step,
    )
    try:
        info["auto_attention"] = auto_attention_choice(spec, device, dtype)
    except Exception as exc:  # noqa: BLE001
        info["auto_attention"] = dict(backend=None, reason=f"{type(exc).__name__}: {exc}")
    print(f"== {spec.name}: {info['params_billion']}B params, built in {info['build_s']} s; "
          f"omni auto attention -> {info['auto_attention']}", file=sys.stderr)
    rows = []
    reference = None
    eager_ms = eager_loop_ms = None
    for variant in variants:
        row: dict[str, Any] = dict(model=spec.name, variant=variant, label=VARIANT_LABELS[variant])
        undo = None
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            apply_started = time.perf_counter()
            undo = apply_variant(variant, model, device, args, spec)
            row["apply_s"] = round(time.perf_counter() - apply_started, 2)
            if device.type == "cuda":  # the peak while applying (quantization) apart from the forwards'
                row["apply_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                torch.cuda.reset_peak_memory_stats()
            timing, out = time_variant(model, inputs, warmup, iters, device)
            row.update(timing)
            row["step_ms"] = row["forward_ms"] * spec.forwards_per_step
            row["loop_step_ms"] = row["loop_forward_ms"] * spec.forwards_per_step
            if device.type == "cuda":
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if variant == "eager":
                reference = out.detach().clone()
                eager_ms = row["forward_ms"]
                eager_loop_ms = row["loop_forward_ms"]
                row["rel_err"] = 0.0
            elif reference is not None:
                row["rel_err"] = relative_error(out, reference)
            if eager_ms is not None:
                row["speedup"] = eager_ms / row["forward_ms"]
                row["loop_speedup"] = eager_loop_ms / row["loop_forward_ms"]
            row["status"] = "ok"
            print(f"  {variant}: {row['forward_ms']:.1f} ms/forward, step {row['step_ms']:.1f} ms "
                  f"({row['loop_step_ms']:.1f} ms back to back), "
                  f"first call {row['first_call_s']} s, rel err {row.get('rel_err')}", file=sys.stderr)
        except Skip as exc:
            row["status"] = f"skipped: {exc}"
            print(f"  {variant}: {row['status']}", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - record and go on with the next variant
            row["status"] = f"error: {type(exc).__name__}: {exc}".splitlines()[0][:400]
            row["traceback"] = traceback.format_exc()[-3000:]
            print(row["traceback"], file=sys.stderr)
        finally:
            if undo is not None:
                try:
                    undo()
                except Exception as exc:  # noqa: BLE001
                    row["undo_error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    del model, inputs, reference
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, info


# --------------------------------------------------------------------------- report


def _fmt(value, digits=1, suffix=""):
    if value is None:
        return "-"
    return f"{value:.{digits}f}{suffix}"


def targets(rows: list[dict]) -> list[str]:
    lines = []
    by = {(r["model"], r["variant"]): r for r in rows}
    flux_d = by.get((MODELS["flux"].name, "omni_fp8"))
    # (d) and its CUDA-graph forms: compile "optionally with CUDA graphs" (issue 6), so each is
    # judged against the target on its own line.
    for variant in ("omni_fp8", "omni_fp8_cuda_graphs", "omni_fp8_int8_modulation_cuda_graphs"):
        row = by.get((MODELS["flux"].name, variant))
        if row is None:
            continue
        label = VARIANT_LABELS[variant].split(" ", 1)[0]
        if row.get("status") != "ok":
            lines.append(f"Flux {label}: {row.get('status')}")
            continue
        for key, how in (("step_ms", "each forward synchronized"),
                         ("loop_step_ms", "forwards back to back, as a denoising loop runs them")):
            ok = row[key] <= 90.0
            lines.append(f"Flux {label} step {row[key]:.1f} ms ({how}) vs target <= 90 ms: "
                         f"{'MET' if ok else 'NOT MET'}")
    flux_d0 = by.get((MODELS["flux"].name, "omni_fp8_unfused"))
    if flux_d is not None and flux_d0 is not None and "ok" == flux_d.get("status") == flux_d0.get("status"):
        lines.append(f"Flux q/k/v fusion: (d0) {flux_d0['step_ms']:.1f} ms -> (d) {flux_d['step_ms']:.1f} ms")
    wan_e = by.get((MODELS["wan"].name, "omni_fp8_sage"))
    if wan_e is not None:
        if wan_e.get("status") == "ok" and wan_e.get("speedup") is not None:
            ok = wan_e["speedup"] >= 1.5
            lines.append(f"Wan (e) speedup {wan_e['speedup']:.2f}x vs target >= 1.5x: "
                         f"{'MET' if ok else 'NOT MET'}")
        else:
            lines.append(f"Wan (e): {wan_e.get('status')}")
    return lines


def markdown(env: dict, infos: list[dict], rows: list[dict]) -> str:
    lines = [
        f"# Diffusion transformer step time: {env['device']} ({env['arch']})",
        "",
        f"commit {env['git_commit']}, torch {env['torch']} (CUDA {env['cuda']}), "
        + ", ".join(f"{k} {v}" for k, v in env["packages"].items())
        + f", {env['utc']}; random {env['dtype']} weights, transformer forward only.",
        f"command: `{env['command']}`",
        "",
    ]
    if env.get("models_not_run"):
        lines += [f"Partial report: not run yet: {', '.join(env['models_not_run'])}.", ""]
    for info in infos:
        auto = info.get("auto_attention") or {}
        lines.append(f"- **{info['model']}**: {info['description']}; {info['params_billion']}B params; "
                     f"warmup {info['warmup']}, {info['iters']} timed forwards; omni auto attention: "
                     f"{auto.get('backend') or auto.get('reason')}")
    lines += [
        "",
        "| model | variant | forward ms (median) | step ms | speedup vs (a) | step ms back to back "
        "| speedup back to back | first call s | rel err vs (a) | peak GiB (forwards) | status |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['label']} | {_fmt(r.get('forward_ms'))} | {_fmt(r.get('step_ms'))} "
            f"| {_fmt(r.get('speedup'), 2, 'x')} | {_fmt(r.get('loop_step_ms'))} "
            f"| {_fmt(r.get('loop_speedup'), 2, 'x')} | {_fmt(r.get('first_call_s'), 1)} "
            f"| {'-' if r.get('rel_err') is None else format(r['rel_err'], '.2e')} "
            f"| {_fmt(r.get('peak_gib'), 1)} | {r.get('status')} |"
        )
    target_lines = targets(rows)
    if target_lines:
        lines += ["", "Targets (issue 6):", *[f"- {t}" for t in target_lines]]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    default_models = os.environ.get("OMNI_PIPELINE_MODELS", "flux wan").split()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=default_models)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    parser.add_argument("--warmup", type=int, default=None, help="warm-up calls (default per model)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls (default per model)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="weights and activations (default bfloat16; float32 with --smoke)")
    parser.add_argument("--compile-backend", default="inductor")
    harness.add_out_dir_argument(parser, __file__)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny models on CPU, float32, compile backend 'eager': checks the script")
    args = parser.parse_args(argv)
    if args.dtype is None:
        args.dtype = "float32" if args.smoke else "bfloat16"
    if args.smoke:
        if args.compile_backend == "inductor":
            args.compile_backend = "eager"
    for name in args.models:
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; one of {', '.join(MODELS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.smoke and harness.refuse_without_gpu("bench/pipeline.py"):
        return 2
    try:
        import diffusers  # noqa: F401
    except ImportError as exc:
        print(f"bench/pipeline.py needs diffusers (carry its wheel in .whl/): {exc}", file=sys.stderr)
        return 2
    # "eager" is the reference of every other row: always run it first.
    variants = ["eager"] + [v for v in args.variants if v != "eager"]
    env = harness.base_environment(("triton", "diffusers", "sageattention", "cache-dit"))
    dtype = getattr(torch, args.dtype)
    env.update(dtype=args.dtype, compile_backend=args.compile_backend)
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    specs = SMOKE_MODELS if args.smoke else MODELS
    env.update(smoke=args.smoke)
    started = time.perf_counter()
    rows: list[dict] = []
    infos: list[dict] = []
    subset = "" if sorted(args.models) == sorted(MODELS) else "-" + "-".join(args.models)
    if args.smoke:
        subset += "-smoke"
    stem = harness.record_stem(f"pipeline{subset}", env["device"])

    def write_report(models_left: list[str]) -> str:
        # Written after every model: a run cut short (a time limit) keeps the models it finished.
        env["wall_s"] = round(time.perf_counter() - started, 1)
        env["models_not_run"] = models_left
        md = markdown(env, infos, rows)
        harness.write_record(args.out_dir, stem, dict(environment=env, models=infos, results=rows,
                                                      targets=targets(rows)), md)
        return md

    for index, key in enumerate(args.models):
        try:
            model_rows, info = run_model(specs[key], variants, device, dtype, args)
            rows += model_rows
            infos.append(info)
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(model=specs[key].name, variant="all", label="all",
                             status=f"error: {type(exc).__name__}: {exc}".splitlines()[0][:400],
                             traceback=traceback.format_exc()[-3000:]))
            print(rows[-1]["traceback"], file=sys.stderr)
        md = write_report(list(args.models[index + 1:]))
    print(md)
    failed = [r for r in rows if str(r.get("status", "")).startswith("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
