"""bench/linear.py's transformer step: a whole FluxTransformer2DModel (default config, random
weights, bf16 on the GPU) timed per denoising step in bf16 and with its linears quantized (FP8 /
INT8 W8A8, eager, with the fused QK-norm + RoPE, or regionally compiled)."""

from __future__ import annotations

import gc
import sys
import time
import traceback

import torch
from torch import nn

if __package__:  # imported as bench.<module> (the tests)
    from bench import harness
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import harness

DEVICE = "cuda"
#: Flux modules the quantized step keeps in bf16
FLUX_SKIP = ("x_embedder", "context_embedder", "time_text_embed", "norm_out", "proj_out")

STEP_VARIANTS = ("fp8-eager", "fp8-eager-fused-norm-rope", "fp8-eager-fused-norm-rope-aten", "fp8-compiled",
                 "int8-eager")
# Measured only while time is left (--budget-s).
OPTIONAL_STEP_VARIANTS = ("fp8-eager-fused-norm-rope", "fp8-eager-fused-norm-rope-aten", "int8-eager")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _time_steps(model, inputs, steps: int) -> tuple[float, float, torch.Tensor]:
    """``(median ms, peak GiB during a step, output)``."""
    outputs = []

    def step():
        outputs[:] = [model(**inputs)[0]]

    with torch.no_grad():
        step()
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = harness.call_times_ms(step, steps)
    peak = torch.cuda.max_memory_allocated() / 2**30
    times.sort()
    return times[len(times) // 2], peak, outputs[0]


def _compile_and_warm(model, inputs) -> str:
    """Compile the repeated blocks (regional compilation: one compile per block class) and run
    one step, which is when compilation happens. ``fullgraph=True`` first; if that fails to
    trace, the error is recorded and the blocks are compiled again without it."""
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    try:
        compile_repeated = getattr(model, "compile_repeated_blocks", None)
        if compile_repeated is not None:
            compile_repeated(fullgraph=True)
        else:
            for block in blocks:
                block.compile(fullgraph=True)
        with torch.no_grad():
            model(**inputs)
        torch.cuda.synchronize()
        return "regional torch.compile, fullgraph=True"
    except Exception as exc:  # noqa: BLE001 - recorded in the results
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        print(f"[flux step] fullgraph compile failed, compiling without it: {reason}", file=sys.stderr)
        torch._dynamo.reset()
        for block in blocks:
            block.compile()
        with torch.no_grad():
            model(**inputs)
        torch.cuda.synchronize()
        return f"regional torch.compile, fullgraph=False (fullgraph=True failed: {reason})"


def _model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (what it holds on the GPU)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def run_transformer(budget, steps: int, variants) -> list[dict]:
    """One row per step variant (bf16 eager first, the reference); ``budget`` (linear.py's
    ``_Budget``) says when to skip the optional (and then all) measurements."""
    from omni_diffusion.quantization import QuantConfig, quantize
    from omni_diffusion.testing import full_size_flux_inputs, full_size_flux_transformer

    rows = []
    torch.cuda.empty_cache()
    model = full_size_flux_transformer(DEVICE)
    inputs = full_size_flux_inputs(DEVICE)
    bf16_bytes = _model_bytes(model)
    ms, peak, ref = _time_steps(model, inputs, steps)
    ref = ref.float()
    rows.append(dict(variant="bf16-eager", status="ok", step_ms=ms, peak_gib=peak,
                     model_gib=bf16_bytes / 2**30))
    print(f"[flux step] bf16 eager: {ms:.1f} ms, model {bf16_bytes / 2**30:.2f} GiB, peak {peak:.1f} GiB",
          flush=True)
    bf16_ms = ms

    for method in ("fp8", "int8"):
        wanted = [v for v in variants if v.startswith(method)]
        if not wanted:
            continue
        if budget.exceeded(essential=True):
            rows += [dict(variant=v, status="skipped: time budget") for v in wanted]
            continue
        try:
            if model is None:  # the same random weights again (seeded), for the next method
                model = full_size_flux_transformer(DEVICE)
            quantize(model, QuantConfig(method=method, skip=FLUX_SKIP))
            gc.collect()
            torch.cuda.empty_cache()
            quant_bytes = _model_bytes(model)
        except Exception as exc:
            rows += [dict(variant=v, status=f"error: {type(exc).__name__}: {exc}".splitlines()[0][:400])
                     for v in wanted]
            model = None
            continue
        for variant in wanted:
            row = dict(variant=variant)
            if budget.exceeded(essential=variant not in OPTIONAL_STEP_VARIANTS):
                row["status"] = "skipped: time budget"
                rows.append(row)
                continue
            undo_fused = None
            gemm_backends = {}
            try:
                if variant.endswith("-aten"):  # the same layers with torch._scaled_mm as their GEMM
                    from omni_kernels.quant import QuantizedLinear

                    gemm_backends = {m: m.backend for m in model.modules() if isinstance(m, QuantizedLinear)}
                    for layer in gemm_backends:
                        layer.backend = "aten"
                if "fused-norm-rope" in variant:
                    from omni_diffusion.adapters import adapter_for_transformer

                    undo_fused = adapter_for_transformer(model).apply_fused_norm_rope(model)
                if variant.endswith("compiled"):
                    start = time.monotonic()
                    row["compile"] = _compile_and_warm(model, inputs)
                    row["compile_s"] = time.monotonic() - start
                ms, peak, out = _time_steps(model, inputs, steps)
                row.update(status="ok", step_ms=ms, peak_gib=peak, model_gib=quant_bytes / 2**30,
                           memory_vs_bf16=quant_bytes / bf16_bytes, speedup_vs_bf16_eager=bf16_ms / ms,
                           rel_err_vs_bf16=relative_error(out.float(), ref))
                print(f"[flux step] {variant}: {ms:.1f} ms ({bf16_ms / ms:.2f}x), rel err "
                      f"{row['rel_err_vs_bf16']:.4f}, model {quant_bytes / 2**30:.2f} GiB "
                      f"({row['memory_vs_bf16']:.1%} of bf16), peak {peak:.1f} GiB", flush=True)
            except Exception as exc:
                row["status"] = f"error: {type(exc).__name__}: {exc}".splitlines()[0][:400]
                row["traceback"] = traceback.format_exc()[-3000:]
                print(f"[flux step] {variant} failed:\n{row['traceback']}", file=sys.stderr)
            finally:
                if undo_fused is not None:
                    undo_fused()
                for layer, backend in gemm_backends.items():
                    layer.backend = backend
            rows.append(row)
        model = None
        gc.collect()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows
