#!/usr/bin/env python3
"""Benchmark of omni's attention backends on diffusion-transformer shapes (one GPU, one process).

For each model shape (bf16, non-causal, ``[B, H, S, D]``), every backend that loads runs the
same inputs through :func:`omni_kernels.attention.attention` (``backend=<name>``, so the
dispatch cost is included): omni's kernels (``omni_triton``, the quantized ``omni_sage*``)
beside the peers torch SDPA (cuDNN, flash, memory-efficient), flash-attn 2/3, FlashInfer,
SageAttention (lossy) and xFormers when installed. A backend that does not load is recorded
with the reason, one that cannot take a shape with the constraint it violates; the run goes on.

Per row: the time (``triton.testing.do_bench`` median, L2 flushed); TFLOP/s
(``4 * B * H * Sq * Skv * D / time``); the ratio to ``sdpa_cudnn`` (> 1 is faster); the
relative error against a float32 reference where ``Sq * Skv <= --accuracy-max-scores``; the
host time of omni's backend selection; the GPU clock and power (``gpu_telemetry.py``) for rows
timed long enough, since a power-capped GPU lowers its clock. ``--inputs dit`` uses DiT-like
activations (outlier channels in Q and K, a K bias) instead of ``torch.randn``: on randn the
FP8 kernels sit at FP8's floor for zero-mean V, on DiT-like inputs they show their real error.

``--lossy-sweep`` instead times self-attention lengths (``SWEEP_LENGTHS``, 24 heads x 128) for
``sdpa_cudnn`` and the lossy backends, and reports each one's crossover: the shortest length
from which it is at least ``SWEEP_MIN_GAIN`` times as fast as cuDNN at every longer length
(quantization costs time linear in the sequence, attention quadratic).

Record: ``<out-dir>/attention_<device>_<YYYYMMDD>.json`` and ``.md`` (``-dit`` with DiT-like
inputs) with the commit, device, versions and command; the markdown is printed last.
``--write-auto-table`` rewrites this GPU's entry of ``omni_kernels/attention/auto_table.json``
(a copy goes to the out-dir): backends ranked by median TFLOP/s, lossless ones only unless
``--table-include-lossy``; after a sweep only the lossy part, with the crossovers as
``lossy_min_seq``.

    python3 bench/attention.py [--shapes flux sd35 ...] [--backends omni_triton sdpa_cudnn ...]
    python3 bench/attention.py --lossy-sweep --backends sdpa_cudnn omni_sage omni_sage_sm90 --write-auto-table
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if __package__:  # imported as bench.<script> (the tests)
    from bench import gpu_telemetry, harness
    from bench import shapes as models
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import gpu_telemetry
    import harness
    import shapes as models

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    name: str
    description: str
    batch: int
    heads: int
    seq_q: int
    seq_kv: int
    head_dim: int

    @property
    def flops(self) -> float:
        return 4.0 * self.batch * self.heads * self.seq_q * self.seq_kv * self.head_dim


def _self_attention(model: models.Model) -> Shape:
    return Shape(model.name, model.note, 1, model.heads, model.tokens, model.tokens, model.head_dim)


_WAN = models.WAN_480P
SHAPES = {
    "flux": _self_attention(models.FLUX),
    "sd35": _self_attention(models.SD35),
    "qwen": _self_attention(models.QWEN_IMAGE),
    "wan480": _self_attention(_WAN),
    "wan720": _self_attention(models.WAN_720P),
    "wancross": Shape("wan2.1-14b-cross", f"Wan2.1-14B 480p cross-attention: {_WAN.tokens} queries x "
                      f"{models.TEXT_TOKENS} text keys", 1, _WAN.heads, _WAN.tokens, models.TEXT_TOKENS, _WAN.head_dim),
    "hunyuan": _self_attention(models.HUNYUAN_720P),
}

DEFAULT_BACKENDS = (
    "sdpa_cudnn", "omni_triton", "sdpa_flash", "sdpa_efficient", "flash_attn3", "flash_attn",
    "flashinfer", "sageattention", "omni_sage", "omni_sage_sm90", "xformers",
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BASELINE = "sdpa_cudnn"

# --lossy-sweep: self-attention lengths from below Flux's 4608 to Wan 480p's 32760, at
# Flux's 24 heads x 128 (fewer heads than Wan's 40: fewer CTAs, a conservative crossover).
SWEEP_LENGTHS = (2048, 4608, 7401, 9216, 12288, 16384, 24576, 32760)
SWEEP_HEADS = 24
SWEEP_HEAD_DIM = 128
# A lossy backend must be this much faster than cuDNN to be worth its error.
SWEEP_MIN_GAIN = 1.05


def sweep_shapes() -> list[Shape]:
    return [
        Shape(f"self-{n}", f"crossover sweep: {n} tokens, {SWEEP_HEADS} heads x {SWEEP_HEAD_DIM}",
              1, SWEEP_HEADS, n, n, SWEEP_HEAD_DIM)
        for n in SWEEP_LENGTHS
    ]


def lossy_crossovers(shapes, rows, names, min_gain: float = SWEEP_MIN_GAIN) -> dict[str, int | None]:
    """``{backend: crossover}``: the shortest ``min(Sq, Skv)`` among ``shapes`` from which the
    backend's ``ratio_vs_cudnn`` is >= ``min_gain`` at every longer shape; ``None`` when it is
    not at the longest (or did not run there)."""
    ratio = {(r["shape"], r["backend"]): r.get("ratio_vs_cudnn") for r in rows if r.get("status") == "ok"}
    out: dict[str, int | None] = {}
    for name in names:
        crossover = None
        for shape in sorted(shapes, key=lambda s: -min(s.seq_q, s.seq_kv)):
            x = ratio.get((shape.name, name))
            if x is None or x < min_gain:
                break
            crossover = min(shape.seq_q, shape.seq_kv)
        out[name] = crossover
    return out


def lossy_table_entry(env, previous: dict | None, shapes, rows, crossovers: dict[str, int | None]) -> dict:
    """This arch's auto-table entry with its lossy part replaced by the sweep's result.

    The lossless ranking and its source stay as they were; lossy backends with a crossover go
    first (the fastest at the longest swept length first), with ``lossy_min_seq``."""
    from omni_kernels.attention import get_backend

    entry = dict(previous or {})

    def lossy(name):
        try:
            return get_backend(name).lossy
        except ValueError:  # a name no longer registered: keep it where it was
            return False

    longest = max(shapes, key=lambda s: min(s.seq_q, s.seq_kv)).name
    at_longest = {r["backend"]: r.get("ratio_vs_cudnn", 0.0) for r in rows
                  if r["shape"] == longest and r.get("status") == "ok"}
    chosen = sorted((n for n, c in crossovers.items() if c is not None), key=lambda n: -at_longest[n])
    entry["ranking"] = chosen + [n for n in entry.get("ranking", []) if not lossy(n)]
    entry["lossy_listed"] = chosen
    entry["lossy_min_seq"] = {n: crossovers[n] for n in chosen}
    ran = {r["backend"] for r in rows if r.get("status") == "ok"}
    not_listed = [f"{n} ({'no crossover' if n in ran else 'did not run'})"
                  for n, c in crossovers.items() if c is None]
    entry["lossy_source"] = (
        f"MEASURED by bench/attention.py --lossy-sweep on {env['device']} ({env['arch']}), {env['utc']}, "
        f"commit {env['git_commit']}, torch {env['torch']}, triton {env['packages']['triton']}, "
        f"{env['dtype']} non-causal, {SWEEP_HEADS} heads x {SWEEP_HEAD_DIM}, Sq = Skv in "
        f"{', '.join(str(min(s.seq_q, s.seq_kv)) for s in shapes)}; a lossy backend is listed from the "
        f"shortest length at which it is >= {SWEEP_MIN_GAIN}x {BASELINE} at every longer one"
        + (f"; not listed: {', '.join(not_listed)}" if not_listed else "")
    )
    return entry


# --------------------------------------------------------------------------- measurement


# --inputs: what q, k and v hold.
INPUTS = {
    "randn": "torch.randn (the anchors' inputs)",
    "dit": "DiT-like (reference.dit_like_qkv: outlier channels in Q and K, a large per-channel "
           "bias on a few of K's, V with a per-channel mean)",
}


def _make_inputs(shape: Shape, dtype, layout: str, seed: int, inputs: str = "randn",
                 device: str = "cuda"):
    """``(q, k, v)`` of ``shape`` in ``layout``, ``dtype``, on ``device``, from ``seed``.

    ``inputs="dit"``: :func:`~omni_kernels.attention.quantized.reference.dit_like_qkv`, one call
    for self-attention; when Sq differs from Skv (cross-attention), q from one call and k, v from
    another. Real DiT activations change both the quantized kernels' error and, on a
    power-capped GPU, the clock (more bits toggle).
    """
    if inputs not in INPUTS:
        raise ValueError(f"inputs must be one of {sorted(INPUTS)}; got {inputs!r}")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def to_layout(x):
        return x if layout == "bhsd" else x.transpose(1, 2).contiguous()

    def dims(seq):
        return (shape.batch, shape.heads, seq, shape.head_dim)

    if inputs == "dit":
        from omni_kernels.attention.quantized.reference import dit_like_qkv

        q, k, v = dit_like_qkv(gen, dims(shape.seq_kv), dtype, device)
        if shape.seq_q != shape.seq_kv:
            q = dit_like_qkv(gen, dims(shape.seq_q), dtype, device)[0]
        return to_layout(q), to_layout(k), to_layout(v)

    def one(seq):
        return to_layout(torch.randn(dims(seq), generator=gen, device=device, dtype=dtype))

    return one(shape.seq_q), one(shape.seq_kv), one(shape.seq_kv)


def _heads_view(x, layout, h0, h1):
    return x[:, h0:h1] if layout == "bhsd" else x[:, :, h0:h1]


def _reference(q, k, v, layout: str, heads: int):
    """float32 reference, a few heads at a time (SDPA efficient kernel on float32 copies)."""
    from omni_kernels.attention import attention

    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    seq_q, seq_kv = (q.shape[2], k.shape[2]) if layout == "bhsd" else (q.shape[1], k.shape[1])
    chunk = max(1, min(heads, int(2**31 // max(1, seq_q * q.shape[-1] * 4))))
    for h0 in range(0, heads, chunk):
        h1 = min(heads, h0 + chunk)
        qs, ks, vs = (_heads_view(t, layout, h0, h1).float() for t in (q, k, v))
        try:
            part = attention(qs, ks, vs, backend="sdpa_efficient", layout=layout)
        except Exception:
            part = attention(qs, ks, vs, backend="sdpa_math", layout=layout)
        _heads_view(out, layout, h0, h1).copy_(part)
    return out


def _relative_error(out, ref) -> float:
    out = out.reshape(-1)
    ref = ref.reshape(-1)
    err = 0.0
    norm = 0.0
    step = 1 << 26
    for i in range(0, ref.numel(), step):
        o = out[i:i + step].double()
        r = ref[i:i + step].double()
        err += torch.sum((o - r) ** 2).item()
        norm += torch.sum(r * r).item()
    return math.sqrt(err / norm) if norm else float("nan")


def _bench_args(shape: Shape) -> tuple[float, float]:
    """(warmup ms, rep ms) for do_bench: a few calls of the big shapes, ~100 ms of the small."""
    est_ms = shape.flops / 400e12 * 1e3  # a pessimistic time per call
    if est_ms < 10:
        return 25.0, 100.0
    return est_ms, 3 * est_ms


def _dispatch_us(name, q, k, v, layout, calls=200) -> float:
    from omni_kernels.attention import api

    return harness.host_us(lambda: api._plan(q, k, v, name, layout, False, None, None, False, None), calls)


def _run_shape(shape: Shape, dtype, layout: str, backends, args, unavailable):
    from omni_kernels.attention import attention, select_backend

    q, k, v = _make_inputs(shape, dtype, layout, args.seed, args.inputs)
    ref = None
    if shape.seq_q * shape.seq_kv <= args.accuracy_max_scores:
        ref = _reference(q, k, v, layout, shape.heads)
    rows = []
    warmup, rep = _bench_args(shape)
    for name in backends:
        row = dict(shape=shape.name, backend=name)
        rows.append(row)
        if name in unavailable:
            row["status"] = f"unavailable: {unavailable[name]}"
            continue
        chosen, reason = select_backend(q, k, v, backend=name, layout=layout)
        if chosen is None:
            row["status"] = f"ineligible: {reason}"
            continue
        try:
            fn = lambda: attention(q, k, v, backend=name, layout=layout)  # noqa: E731
            out = fn()
            torch.cuda.synchronize()
            if ref is not None:
                row["rel_err"] = _relative_error(out, ref)
            del out
            with gpu_telemetry.GpuTelemetry(q.device) as telemetry:
                ms = harness.do_bench_us(fn, warmup=warmup, rep=rep) / 1e3
            row["median_ms"] = ms
            gpu = telemetry.summary()
            if gpu is not None:
                row["gpu"] = gpu
            elif telemetry.error is not None:
                row["gpu_error"] = telemetry.error
            row["tflops"] = shape.flops / (ms * 1e-3) / 1e12
            row["dispatch_us"] = _dispatch_us(name, q, k, v, layout)
            row["status"] = "ok"
        except Exception as exc:  # out of memory, a kernel that fails to build, ...
            row["status"] = f"error: {type(exc).__name__}: {exc}".splitlines()[0][:400]
            row["traceback"] = traceback.format_exc()[-3000:]
            print(row["traceback"], file=sys.stderr)
        torch.cuda.empty_cache()
        print(f"  {shape.name:22s} {name:15s} {row['status'][:60]:60s} "
              f"{row.get('tflops', float('nan')):7.1f} TFLOP/s  rel err {row.get('rel_err', float('nan')):.2e}",
              file=sys.stderr, flush=True)
    base = next((r for r in rows if r["backend"] == BASELINE and r.get("status") == "ok"), None)
    for r in rows:
        if base is not None and r.get("status") == "ok":
            r["ratio_vs_cudnn"] = base["median_ms"] / r["median_ms"]
    return rows


# --------------------------------------------------------------------------- reporting


_PEER_DISTRIBUTIONS = ("triton", "diffusers", "flash-attn", "flash-attn-3", "flashinfer-python",
                       "sageattention", "xformers")


def _environment() -> dict:
    return harness.base_environment(_PEER_DISTRIBUTIONS)


def _cell(row) -> str:
    if row is None:
        return "-"
    if row.get("status") != "ok":
        status = row.get("status", "")
        return "n/a" if status.startswith("unavailable") else status.split(":")[0]
    ratio = row.get("ratio_vs_cudnn")
    return f"{row['tflops']:.0f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def _provenance_lines(env) -> list[str]:
    return [
        f"- device: {env['device']} ({env['arch']}); torch {env['torch']} (CUDA {env['cuda']}, "
        f"cuDNN {env['cudnn']}), triton {env['packages']['triton']}, python {env['python']}",
        f"- git commit: {env['git_commit']}; {env['utc']}",
        f"- command: `{env['command']}`",
    ]


def _markdown(env, shapes, backends, rows, unavailable, table_entry) -> str:
    ran = [b for b in backends if b not in unavailable]
    lines = [
        "# Attention backends",
        "",
        *_provenance_lines(env),
        f"- {env['dtype']}, non-causal, layout {env['layout']}; TFLOP/s = 4*B*H*Sq*Skv*D / median "
        f"time (triton.testing.do_bench, L2 flushed); (x) = speed relative to {BASELINE}; "
        "through omni_kernels.attention.attention (dispatch included).",
        f"- inputs: {INPUTS[env.get('inputs', 'randn')]}",
        "",
        "## TFLOP/s",
        "",
        "| shape | " + " | ".join(ran) + " |",
        "| --- | " + " | ".join("---:" for _ in ran) + " |",
    ]
    index = {(r["shape"], r["backend"]): r for r in rows}
    for s in shapes:
        lines.append(f"| {s.name} | " + " | ".join(_cell(index.get((s.name, b))) for b in ran) + " |")
    lines += ["", "## Relative error vs float32 reference", "",
              "| shape | " + " | ".join(ran) + " |", "| --- | " + " | ".join("---:" for _ in ran) + " |"]
    for s in shapes:
        cells = []
        for b in ran:
            r = index.get((s.name, b))
            cells.append(f"{r['rel_err']:.1e}" if r and "rel_err" in r else "-")
        lines.append(f"| {s.name} | " + " | ".join(cells) + " |")
    notes = [r for r in rows if r.get("status", "ok") != "ok" and not r["status"].startswith("unavailable")]
    if notes:
        lines += ["", "## Not run", ""]
        lines += [f"- {r['shape']} / {r['backend']}: {r['status']}" for r in notes]
    if unavailable:
        lines += ["", "## Unavailable backends", ""]
        lines += [f"- {name}: {reason}" for name, reason in unavailable.items()]
    dispatch = {}
    for r in rows:
        if "dispatch_us" in r:
            dispatch.setdefault(r["backend"], []).append(r["dispatch_us"])
    if dispatch:
        lines += ["", "Dispatch (backend selection, host) us per call: "
                  + ", ".join(f"{b} {statistics.median(v):.0f}" for b, v in dispatch.items())]
    lines += _telemetry_lines(rows)
    if table_entry is not None:
        lines += ["", f"auto table ({env['arch']}): " + " > ".join(table_entry["ranking"])]
    return "\n".join(lines)


def _telemetry_lines(rows) -> list[str]:
    """A table of the SM clock and power sampled while each row was timed (rows timed for long
    enough to sample; at the power cap a speed ratio is a ratio of energy per unit of work)."""
    sampled = [r for r in rows if r.get("gpu")]
    if not sampled:
        return []
    lines = ["", "## GPU clock and power while timing (nvidia-smi, medians)", "",
             "| shape | backend | SM clock (MHz) | power (W) | under the power cap | samples |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in sampled:
        g = r["gpu"]
        lines.append(f"| {r['shape']} | {r['backend']} | {g['sm_clock_mhz']:.0f} | {g['power_w']:.0f} | "
                     f"{100 * g['power_capped_share']:.0f}% | {g['samples']} |")
    return lines


def _table_entry(env, shapes, rows, include_lossy: bool, previous: dict | None) -> dict:
    from omni_kernels.attention import get_backend, list_backends

    per_backend: dict[str, list[float]] = {}
    for r in rows:
        if r.get("status") == "ok":
            per_backend.setdefault(r["backend"], []).append(r["tflops"])
    medians = {}
    full = {}
    for name, values in per_backend.items():
        if get_backend(name).lossy and not include_lossy:
            continue
        medians[name] = statistics.median(values)
        full[name] = len(values) == len(shapes)
    # Backends that ran every shape first (their medians compare like with like), then the
    # ones that could not take some shape; each group by median TFLOP/s.
    ranking = sorted(medians, key=lambda n: (not full[n], -medians[n]))
    registered = list_backends()
    # Unmeasured lossless backends keep their previous relative order, after the measured ones.
    for name in list((previous or {}).get("ranking", [])) + registered:
        if name in ranking or name == "sdpa_math" or name not in registered:
            continue
        if get_backend(name).lossy:
            continue
        ranking.append(name)
    ranking.append("sdpa_math")
    lossy = [n for n in ranking if get_backend(n).lossy]
    kept = {}
    if not include_lossy and previous and previous.get("lossy_min_seq"):
        # A lossless-only run keeps the last --lossy-sweep's result (it measured other shapes).
        kept = {n: c for n, c in previous["lossy_min_seq"].items() if n in registered}
        ranking = [n for n in previous.get("lossy_listed", []) if n in kept] + ranking
        lossy = list(kept)
    entry = dict(
        source=(
            f"MEASURED by bench/attention.py on {env['device']} ({env['arch']}), {env['utc']}, "
            f"commit {env['git_commit']}, torch {env['torch']} (CUDA {env['cuda']}, cuDNN "
            f"{env['cudnn']}), triton {env['packages']['triton']}, {env['dtype']} non-causal; "
            f"ranked by median TFLOP/s over {', '.join(s.name for s in shapes)} (backends that "
            "ran every shape first)"
            + ("; lossy backends included" if include_lossy else "; lossless backends only")
            + ". Unmeasured backends follow in their previous order; sdpa_math last."
        ),
        ranking=ranking,
        median_tflops={n: round(v, 1) for n, v in sorted(medians.items(), key=lambda kv: -kv[1])},
        lossy_listed=lossy,
    )
    if kept:
        entry.update(lossy_min_seq=kept, lossy_source=previous.get("lossy_source", ""))
    return entry


def _sweep_markdown(env, shapes, backends, rows, unavailable, crossovers, table_entry) -> str:
    ran = [b for b in backends if b not in unavailable]
    index = {(r["shape"], r["backend"]): r for r in rows}
    lines = [
        "# Lossy attention crossover sweep",
        "",
        *_provenance_lines(env),
        f"- {env['dtype']}, non-causal, layout {env['layout']}, B=1, {SWEEP_HEADS} heads x {SWEEP_HEAD_DIM}, "
        f"Sq = Skv; TFLOP/s = 4*B*H*Sq*Skv*D / median time (triton.testing.do_bench, L2 flushed); "
        f"(x) = speed relative to {BASELINE}; quantization included; through "
        "omni_kernels.attention.attention (dispatch included).",
        f"- inputs: {INPUTS[env.get('inputs', 'randn')]}",
        "",
        "| tokens | " + " | ".join(ran) + " |",
        "| ---: | " + " | ".join("---:" for _ in ran) + " |",
    ]
    for s in shapes:
        lines.append(f"| {s.seq_q} | " + " | ".join(_cell(index.get((s.name, b))) for b in ran) + " |")
    lines += ["", f"Crossover (shortest length from which >= {SWEEP_MIN_GAIN}x {BASELINE} at every longer one):"]
    lines += [f"- {n}: {c if c is not None else 'none in the sweep'}" for n, c in crossovers.items()]
    if unavailable:
        lines += ["", "## Unavailable backends", ""]
        lines += [f"- {name}: {reason}" for name, reason in unavailable.items()]
    if table_entry is not None:
        lines += ["", f"auto table ({env['arch']}): " + " > ".join(table_entry["ranking"])
                  + f"; lossy_min_seq {json.dumps(table_entry.get('lossy_min_seq', {}))}"]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Benchmark omni's attention backends on DiT shapes.")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--backends", nargs="+", default=list(DEFAULT_BACKENDS),
                        help="registered backend names (default: all but sdpa_math)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd")
    harness.add_out_dir_argument(parser, __file__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inputs", choices=sorted(INPUTS), default="randn",
                        help="randn (default, as the anchors) or dit: DiT-like activations "
                             "(outlier channels; the quantized kernels' real error, and the "
                             "power a capped GPU draws on them)")
    parser.add_argument("--accuracy-max-scores", type=float, default=1.1e9,
                        help="check accuracy on shapes with Sq*Skv up to this (default 1.1e9)")
    parser.add_argument("--write-auto-table", action="store_true",
                        help="rewrite this GPU's entry of omni_kernels/attention/auto_table.json")
    parser.add_argument("--table-include-lossy", action="store_true",
                        help="let lossy backends (sageattention) into the written ranking")
    parser.add_argument("--lossy-sweep", action="store_true",
                        help="sweep self-attention lengths for cuDNN and the lossy --backends and report "
                             "each one's crossover (with --write-auto-table: write it as lossy_min_seq)")
    parser.add_argument("--auto-table-path", type=Path,
                        default=REPO_ROOT / "omni_kernels" / "attention" / "auto_table.json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if harness.refuse_without_gpu("bench/attention.py"):
        return 2

    from omni_kernels.attention import get_backend, list_backends

    for name in args.backends:
        if name not in list_backends():
            print(f"unknown backend {name!r}; registered: {', '.join(list_backends())}", file=sys.stderr)
            return 2
    lossy_names = [b for b in args.backends if get_backend(b).lossy] if args.lossy_sweep else []
    if args.lossy_sweep and not lossy_names:
        print("--lossy-sweep needs at least one lossy backend in --backends (e.g. omni_sage_sm90)",
              file=sys.stderr)
        return 2
    env = _environment()
    env.update(dtype=args.dtype, layout=args.layout, inputs=args.inputs)
    if args.lossy_sweep and args.write_auto_table:
        # the sweep writes only the lossy part: an arch without a measured lossless ranking
        # would get a table of lossy backends alone, with no lossless fallback order or source
        path = args.auto_table_path
        known = json.loads(path.read_text()).get("archs", {}) if path.exists() else {}
        if env["arch"] not in known:
            print(f"--lossy-sweep --write-auto-table: {path} has no entry for {env['arch']} yet; "
                  f"measure its lossless ranking first (bench/attention.py --write-auto-table), "
                  f"then run the sweep", file=sys.stderr)
            return 2
    device = torch.device("cuda", torch.cuda.current_device())
    unavailable = {}
    for name in args.backends:
        reason = get_backend(name).unavailable_reason(device)
        if reason is None and get_backend(name).min_capability is not None:
            if torch.cuda.get_device_capability() < get_backend(name).min_capability:
                reason = f"needs compute capability >= {get_backend(name).min_capability}"
        if reason is not None:
            unavailable[name] = reason
    for name, reason in unavailable.items():
        print(f"  {name}: unavailable: {reason}", file=sys.stderr)

    shapes = [SHAPES[s] for s in args.shapes]
    backends = list(args.backends)
    if args.lossy_sweep:
        shapes = sweep_shapes()
        backends = [BASELINE] + lossy_names
        args.accuracy_max_scores = 0  # a timing sweep: the model-shape run reports accuracy
    dtype = DTYPES[args.dtype]
    started = time.perf_counter()
    rows = []
    for shape in shapes:
        try:
            rows += _run_shape(shape, dtype, args.layout, backends, args, unavailable)
        except Exception as exc:
            rows.append(dict(shape=shape.name, backend="all",
                             status=f"error: {type(exc).__name__}: {exc}".splitlines()[0][:400],
                             traceback=traceback.format_exc()[-3000:]))
            print(rows[-1]["traceback"], file=sys.stderr)
        torch.cuda.empty_cache()
    env["wall_s"] = round(time.perf_counter() - started, 1)

    table_entry = None
    crossovers = lossy_crossovers(shapes, rows, lossy_names) if args.lossy_sweep else {}
    kind = ("attention-lossy-sweep" if args.lossy_sweep else "attention") + (
        "" if args.inputs == "randn" else f"-{args.inputs}")
    stem = harness.record_stem(kind, env["device"])
    if args.write_auto_table:
        path = args.auto_table_path
        table = json.loads(path.read_text()) if path.exists() else {"format": 1, "archs": {}}
        previous = table.setdefault("archs", {}).get(env["arch"])
        if args.lossy_sweep:
            table_entry = lossy_table_entry(env, previous, shapes, rows, crossovers)
        else:
            table_entry = _table_entry(env, shapes, rows, args.table_include_lossy, previous)
        table["archs"][env["arch"]] = table_entry
        path.write_text(json.dumps(table, indent=2) + "\n")
        harness.write_record(args.out_dir, f"auto_table_{stem}", table, None)
        print(f"wrote {path} ({env['arch']})", file=sys.stderr)

    if args.lossy_sweep:
        md = _sweep_markdown(env, shapes, backends, rows, unavailable, crossovers, table_entry)
    else:
        md = _markdown(env, shapes, backends, rows, unavailable, table_entry)
    harness.write_record(args.out_dir, stem, dict(
        environment=env, shapes=[dict(asdict(s), flops=s.flops) for s in shapes], unavailable=unavailable,
        results=rows, auto_table_entry=table_entry, lossy_crossovers=crossovers or None), md)
    print(md)
    failed = [r for r in rows if str(r.get("status", "")).startswith("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
