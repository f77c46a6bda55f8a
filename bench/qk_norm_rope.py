#!/usr/bin/env python3
"""Benchmark of the fused QK-RMSNorm + RoPE against what diffusers runs today.

On one GPU, in one process, on the same inputs, for each model shape:

* ``diffusers-eager``: the unfused sequence a diffusers attention processor
  runs: ``RMSNorm`` on q and on k (``diffusers.models.normalization.RMSNorm``),
  then ``apply_rotary_emb`` on each (``diffusers.models.embeddings``,
  ``use_real=True, use_real_unbind_dim=-1, sequence_dim=1``). When diffusers
  does not import, a line-for-line re-statement of those two functions is used
  instead, and the results say so. For Wan the norm runs over ``H*D`` before
  the heads are split, as ``WanAttnProcessor`` does.
* ``diffusers-compile``: the same sequence under ``torch.compile`` (Inductor,
  default mode, ``dynamic=False``).
* ``omni-triton`` / ``omni-cuda``: :func:`omni_kernels.qk_rmsnorm_rope` with
  ``backend="triton"`` / ``"cuda"`` (the latter only when the compiled
  extension is built; otherwise recorded as unavailable, with the reason).

Timing: ``triton.testing.do_bench`` (median of per-call CUDA-event times; it
flushes L2 before each call, so the host's launch work mostly overlaps the
flush and the figure is GPU time) over inputs rotated through enough sets that
they also exceed L2. ``loop us`` is the wall time per call of back-to-back
calls (CUDA events around a loop, no flush): it includes launch and Python
overhead wherever the host is the bottleneck. Bandwidth counts the bytes the
op must move: q and k read and written once, the cos/sin rows and the weights
read once. Each backend's output is also checked against the float32
reference (relative Frobenius error), in the same run.

``graph us`` is the GPU time alone: the calls captured in a CUDA graph and
replayed, so neither launch nor Python overhead counts; it is what a
CUDA-graphed pipeline would see. Set ``OMNI_GIT_COMMIT`` to record the commit
when the tree has no ``.git`` (a copied checkout).

Output: ``<out-dir>/qk_norm_rope_<device>_<YYYYMMDD>.json`` and ``.md``; the
markdown table is printed last. A backend that fails is recorded with its
error and the run goes on.

    python3 bench/qk_norm_rope.py [--shapes flux wan qwen-image] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__:  # imported as bench.<script> (the tests)
    from bench import harness
    from bench import shapes as models
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import harness
    import shapes as models

REPO_ROOT = Path(__file__).resolve().parents[1]
    # Run from a source checkout without installing the package.


@dataclass(frozen=True)
class Shape:
    """One model's q/k at one resolution: ``[B, S, H, D]`` for both."""

    name: str
    description: str
    batch: int
    seq: int
    heads: int
    head_dim: int
    norm_across_heads: bool
    interleaved: bool = True
    eps: float = 1e-6


SHAPES = {
    "flux": Shape(
        "flux-1024", "Flux.1 1024x1024: 4096 image + 512 text tokens, 24 heads x 128, per-head norm",
        1, models.FLUX.tokens, models.FLUX.heads, models.FLUX.head_dim, norm_across_heads=False,
    ),
    "wan": Shape(
        "wan2.1-14b-720p-81f",
        "Wan2.1 14B 1280x720, 81 frames: 21x45x80 latent tokens, 40 heads x 128, norm over H*D",
        1, models.WAN_720P.tokens, models.WAN_720P.heads, models.WAN_720P.head_dim, norm_across_heads=True,
    ),
    "qwen-image": Shape(
        "qwen-image-1328",
        "Qwen-Image 1328x1328: 83x83 image + 512 text tokens, 24 heads x 128, per-head norm",
        1, models.QWEN_IMAGE.tokens, models.QWEN_IMAGE.heads, models.QWEN_IMAGE.head_dim, norm_across_heads=False,
    ),
}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BACKENDS = ("diffusers-eager", "diffusers-compile", "omni-triton", "omni-cuda")


# --------------------------------------------------------------------------- the unfused baseline


class _RestatedRMSNorm(torch.nn.Module):
    """diffusers' ``RMSNorm`` (elementwise_affine=True, no bias), restated.

    Same arithmetic and the same roundings: mean square in float32, the
    product with rsqrt in float32, rounded to the weight's dtype when that is
    half precision, then multiplied by the weight.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden_states = hidden_states.to(self.weight.dtype)
        hidden_states = hidden_states * self.weight
        return hidden_states.to(input_dtype)


def _restated_apply_rotary_emb(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=1):
    """diffusers' ``apply_rotary_emb(x, (cos, sin), use_real=True, ...)``, restated.

    ``x``: ``[B, S, H, D]`` with ``sequence_dim=1``; ``cos``/``sin``: ``[S, D]``
    float32. The rotation is computed in float32 and rounded to ``x``'s dtype
    (a second rounding after the norm's).
    """
    if not use_real:
        raise ValueError("use_real=False (complex freqs) is not restated here; pass use_real=True")
    cos, sin = freqs_cis
    if sequence_dim == 2:
        cos, sin = cos[None, None, :, :], sin[None, None, :, :]
    else:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    cos, sin = cos.to(x.device), sin.to(x.device)
    if use_real_unbind_dim == -1:
        x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    else:
        x_real, x_imag = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)
        x_rotated = torch.cat([-x_imag, x_real], dim=-1)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def _diffusers_parts():
    """``(RMSNorm class, apply_rotary_emb, description)``: diffusers' own, or the re-statement."""
    try:
        import diffusers
        from diffusers.models.embeddings import apply_rotary_emb
        from diffusers.models.normalization import RMSNorm
    except Exception as exc:  # ImportError, or a diffusers that fails on this torch
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return (
            _RestatedRMSNorm,
            _restated_apply_rotary_emb,
            f"re-statement of diffusers RMSNorm + apply_rotary_emb (diffusers not importable: {reason})",
        )
    # sequence_dim appeared in diffusers 0.33; older versions take [B, H, S, D] only.
    import inspect

    if "sequence_dim" not in inspect.signature(apply_rotary_emb).parameters:
        return (
            RMSNorm,
            _restated_apply_rotary_emb,
            f"diffusers {diffusers.__version__} RMSNorm + re-stated apply_rotary_emb "
            "(this version's apply_rotary_emb has no sequence_dim)",
        )
    return (
        RMSNorm,
        apply_rotary_emb,
        f"diffusers {diffusers.__version__} RMSNorm + apply_rotary_emb",
    )


class UnfusedQKNormRope(torch.nn.Module):
    """The diffusers sequence: norm_q, norm_k, then RoPE on each (all ``[B, S, H, D]``)."""

    def __init__(self, rms_norm_cls, apply_rotary_emb, shape: Shape, q_weight, k_weight):
        super().__init__()
        norm_dim = shape.heads * shape.head_dim if shape.norm_across_heads else shape.head_dim
        self.norm_q = rms_norm_cls(norm_dim, eps=shape.eps)
        self.norm_k = rms_norm_cls(norm_dim, eps=shape.eps)
        with torch.no_grad():
            self.norm_q.weight = torch.nn.Parameter(q_weight.clone(), requires_grad=False)
            self.norm_k.weight = torch.nn.Parameter(k_weight.clone(), requires_grad=False)
        self.apply_rotary_emb = apply_rotary_emb
        self.shape = shape

    def forward(self, q, k, cos, sin):
        if self.shape.norm_across_heads:
            # Wan: norm over the whole projection, then split heads.
            q = self.norm_q(q.flatten(2)).unflatten(2, (self.shape.heads, -1))
            k = self.norm_k(k.flatten(2)).unflatten(2, (self.shape.heads, -1))
        else:
            q = self.norm_q(q)
            k = self.norm_k(k)
        unbind_dim = -1 if self.shape.interleaved else -2
        rope = dict(use_real=True, use_real_unbind_dim=unbind_dim, sequence_dim=1)
        return (
            self.apply_rotary_emb(q, (cos, sin), **rope),
            self.apply_rotary_emb(k, (cos, sin), **rope),
        )


# --------------------------------------------------------------------------- inputs and metrics


def _rope_tables(seq, head_dim, interleaved, device, theta=10000.0):
    """float32 ``[S, D]`` cos/sin as diffusers builds them (each value twice per pair)."""
    pos = torch.arange(seq, device=device, dtype=torch.float64)
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    angles = pos[:, None] * inv_freq[None, :]
    angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
    return torch.cos(angles).float().contiguous(), torch.sin(angles).float().contiguous()


def _activations(shape: Shape, dtype, device, gen):
    """``[B, S, H, D]`` normal values with 3 outlier channels (x10-x30), as real q/k have."""
    x = torch.randn(shape.batch, shape.seq, shape.heads, shape.head_dim, device=device,
                    generator=gen, dtype=torch.float32)
    channels = torch.randperm(shape.head_dim, device=device, generator=gen)[:3]
    x[..., channels] *= 10.0 + 20.0 * torch.rand(3, device=device, generator=gen)
    return x.to(dtype)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.reshape(-1), ref.reshape(-1)
    err_sq = ref_sq = 0.0
    for start in range(0, out.numel(), 1 << 26):
        o = out[start : start + (1 << 26)].double()
        r = ref[start : start + (1 << 26)].double()
        err_sq += torch.sum((o - r) ** 2).item()
        ref_sq += torch.sum(r * r).item()
    return math.sqrt(err_sq / ref_sq) if ref_sq else float("nan")


def _bytes_moved(shape: Shape, dtype, weight_numel: int) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    activations = shape.batch * shape.seq * 2 * shape.heads * shape.head_dim * element
    tables = 2 * shape.seq * shape.head_dim * 4
    weights = 2 * weight_numel * element
    return 2 * activations + tables + weights


# --------------------------------------------------------------------------- timing


def _time_backend(fn, num_sets: int, loop_calls: int):
    """``(median us, loop us)`` of ``fn(set_index)``; see the module docstring."""
    import triton.testing

    counter = [0]

    def call():
        fn(counter[0] % num_sets)
        counter[0] += 1

    median_ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(loop_calls):
        call()
    end.record()
    end.synchronize()
    loop_ms = start.elapsed_time(end) / loop_calls
    return median_ms * 1e3, loop_ms * 1e3


def _graph_time(fn, num_sets: int, calls: int = 24, replays: int = 5) -> float:
    """GPU microseconds per call with no host overhead: ``calls`` calls (rotating
    over the input sets) captured in one CUDA graph, replayed ``replays`` times."""
    calls = max(calls, num_sets) // num_sets * num_sets
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
        for i in range(num_sets):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(calls):
            fn(c % num_sets)  # outputs are dropped, so the graph's pool reuses them
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    us = start.elapsed_time(end) * 1e3 / (calls * replays)
    del graph
    return us


# --------------------------------------------------------------------------- one shape


def _run_shape(shape: Shape, dtype, backends, l2_bytes: int, seed: int, loop_calls: int):
    import omni_kernels
    from omni_kernels.qk_norm_rope.reference import qk_rmsnorm_rope_reference

    device = torch.device("cuda")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    weight_numel = shape.heads * shape.head_dim if shape.norm_across_heads else shape.head_dim
    bytes_moved = _bytes_moved(shape, dtype, weight_numel)
    # Enough input sets that one pass over them is at least 4x L2: consecutive
    # calls then never find their inputs in cache, even without do_bench's flush.
    per_set = bytes_moved
    num_sets = max(1, math.ceil(4 * l2_bytes / per_set))

    sets = [
        (_activations(shape, dtype, device, gen), _activations(shape, dtype, device, gen))
        for _ in range(num_sets)
    ]
    q_weight = (1.0 + 0.5 * torch.randn(weight_numel, device=device, generator=gen)).to(dtype)
    k_weight = (1.0 + 0.5 * torch.randn(weight_numel, device=device, generator=gen)).to(dtype)
    cos, sin = _rope_tables(shape.seq, shape.head_dim, shape.interleaved, device)

    q0, k0 = sets[0]
    ref_q, ref_k = qk_rmsnorm_rope_reference(
        q0.float(), k0.float(), q_weight.float(), k_weight.float(), cos, sin,
        eps=shape.eps, interleaved=shape.interleaved, norm_across_heads=shape.norm_across_heads,
    )

    rms_norm_cls, apply_rotary_emb, baseline = _diffusers_parts()
    unfused = UnfusedQKNormRope(rms_norm_cls, apply_rotary_emb, shape, q_weight, k_weight).to(device)

    def omni_call(backend):
        def fn(i):
            q, k = sets[i]
            return omni_kernels.qk_rmsnorm_rope(
                q, k, q_weight, k_weight, cos, sin, eps=shape.eps, interleaved=shape.interleaved,
                norm_across_heads=shape.norm_across_heads, backend=backend,
            )
        return fn

    def make(backend):
        """The callable for ``backend``, or raise ``_Unavailable`` with the reason."""
        if backend == "diffusers-eager":
            return lambda i: unfused(*sets[i], cos, sin)
        if backend == "diffusers-compile":
            compiled = torch.compile(unfused, dynamic=False)
            return lambda i: compiled(*sets[i], cos, sin)
        if backend == "omni-triton":
            return omni_call("triton")
        if backend == "omni-cuda":
            if not omni_kernels.has_compiled_extension():
                from omni_kernels._extension import compiled_extension_error

                raise _Unavailable(compiled_extension_error())
            return omni_call("cuda")
        raise ValueError(backend)

    rows = []
    baseline_us = None
    for backend in backends:
        row = dict(shape=shape.name, backend=backend, dtype=str(dtype).replace("torch.", ""),
                   bytes=bytes_moved, input_sets=num_sets)
        if backend.startswith("diffusers"):
            row["implementation"] = baseline
        try:
            fn = make(backend)
            with torch.no_grad():
                out_q, out_k = fn(0)  # also the warm-up / compilation call
                torch.cuda.synchronize()
                row["rel_err_q"] = _relative_error(out_q, ref_q)
                row["rel_err_k"] = _relative_error(out_k, ref_k)
                del out_q, out_k
                median_us, loop_us = _time_backend(fn, num_sets, loop_calls)
            row.update(status="ok", median_us=median_us, loop_us=loop_us,
                       gb_per_s=bytes_moved / (median_us * 1e-6) / 1e9)
            try:
                with torch.no_grad():
                    row["graph_us"] = _graph_time(fn, num_sets)
                row["graph_gb_per_s"] = bytes_moved / (row["graph_us"] * 1e-6) / 1e9
            except Exception as exc:  # capture can fail where eager works; keep the rest
                row["graph_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                torch.cuda.synchronize()
            if backend == "diffusers-eager":
                baseline_us = median_us
        except _Unavailable as exc:
            row["status"] = f"unavailable: {exc}"
        except Exception as exc:
            row["status"] = f"error: {type(exc).__name__}: {exc}".splitlines()[0][:500]
            row["traceback"] = traceback.format_exc()[-4000:]
            print(f"[{shape.name}] {backend} failed:\n{row['traceback']}", file=sys.stderr)
        rows.append(row)
        print(f"[{shape.name}] {backend}: {row.get('status')} "
              + (f"{row['median_us']:.1f} us, {row['gb_per_s']:.0f} GB/s, "
                 f"rel err q {row['rel_err_q']:.2e} k {row['rel_err_k']:.2e}"
                 if row.get("status") == "ok" else ""), flush=True)
        torch.cuda.empty_cache()
    for row in rows:
        if row.get("status") == "ok" and baseline_us is not None:
            row["speedup_vs_diffusers_eager"] = baseline_us / row["median_us"]
    return rows


class _Unavailable(Exception):
    pass


# --------------------------------------------------------------------------- reporting


def _environment() -> dict:
    env = harness.base_environment(("triton", "diffusers"))
    env["triton"] = env["packages"]["triton"]
    env["diffusers"] = env["packages"]["diffusers"]
    return env


def _markdown(env: dict, shapes, rows) -> str:
    lines = [
        "# Fused QK-RMSNorm + RoPE",
        "",
        f"- device: {env['device']}; torch {env['torch']} (CUDA {env['cuda']}), triton "
        f"{env['triton']}, diffusers {env['diffusers']}",
        f"- git commit: {env['git_commit']}; {env['utc']}",
        f"- command: `{env['command']}`",
        "- median us: triton.testing.do_bench median (L2 flushed before each call; host work "
        "beyond the flush's length shows up); loop us: back-to-back calls, launch and Python "
        "overhead included; graph us: GPU time alone (calls captured in a CUDA graph, inputs "
        "rotated past L2). GB/s from median us and graph us over the bytes the op must move "
        "(q, k read + written, cos/sin, weights); speedup from median us; rel err vs the float32 "
        "reference.",
        "",
    ]
    for shape in shapes:
        impl = next((r.get("implementation") for r in rows if r["shape"] == shape.name
                     and r.get("implementation")), None)
        lines += [
            f"## {shape.name}",
            "",
            f"{shape.description}; B={shape.batch}, S={shape.seq}, H={shape.heads}, "
            f"D={shape.head_dim}, interleaved={shape.interleaved}, "
            f"norm_across_heads={shape.norm_across_heads}.",
            "",
        ]
        if impl:
            lines += [f"Baseline: {impl}.", ""]
        lines += [
            "| backend | median us | loop us | graph us | GB/s | graph GB/s | speedup vs diffusers eager "
            "| rel err q | rel err k | status |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in rows:
            if r["shape"] != shape.name:
                continue
            if r.get("status") == "ok":
                speedup = r.get("speedup_vs_diffusers_eager")
                graph_us = f"{r['graph_us']:.1f}" if "graph_us" in r else "-"
                graph_bw = f"{r['graph_gb_per_s']:.0f}" if "graph_gb_per_s" in r else "-"
                status = "ok" + (
                    f" (graph: {r['graph_error']})".replace("|", "/") if "graph_error" in r else ""
                )
                lines.append(
                    f"| {r['backend']} | {r['median_us']:.1f} | {r['loop_us']:.1f} | {graph_us} | "
                    f"{r['gb_per_s']:.0f} | {graph_bw} | {f'{speedup:.2f}x' if speedup else '-'} | "
                    f"{r['rel_err_q']:.2e} | {r['rel_err_k']:.2e} | {status} |"
                )
            else:
                status = str(r.get("status", "")).replace("|", "/")
                lines.append(f"| {r['backend']} | - | - | - | - | - | - | - | - | {status} |")
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark fused QK-RMSNorm + RoPE (omni triton/cuda) against diffusers' "
        "unfused RMSNorm + apply_rotary_emb, eager and torch.compile.",
    )
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES),
                        help="model shapes to run (default: all)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                        help="backends to run (default: all); diffusers-eager is the speedup baseline")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results",
                        help="where the .json and .md go (default: bench/results)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loop-calls", type=int, default=50,
                        help="calls in the back-to-back 'loop us' measurement")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    refusal = harness.gpu_refusal("bench/qk_norm_rope.py")
    if refusal:
        print(refusal, file=sys.stderr)
        return 2

    env = _environment()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2_bytes = getattr(props, "L2_cache_size", 0) or 60 * 2**20
    env["l2_bytes"] = l2_bytes
    dtype = DTYPES[args.dtype]
    shapes = [SHAPES[name] for name in args.shapes]
    backends = list(args.backends)
    # The speedup baseline runs first so every row can be compared with it.
    if "diffusers-eager" in backends:
        backends.remove("diffusers-eager")
        backends.insert(0, "diffusers-eager")

    rows = []
    for shape in shapes:
        try:
            rows += _run_shape(shape, dtype, backends, l2_bytes, args.seed, args.loop_calls)
        except Exception as exc:  # inputs did not fit, say: record and go on
            rows.append(dict(shape=shape.name, backend="all",
                             status=f"error: {type(exc).__name__}: {exc}".splitlines()[0][:500],
                             traceback=traceback.format_exc()[-4000:]))
            print(rows[-1]["traceback"], file=sys.stderr)
        torch.cuda.empty_cache()

    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"qk_norm_rope_{harness.device_slug(env['device'])}_{_dt.datetime.now(_dt.timezone.utc):%Y%m%d}"
    shape_info = [dict(vars(s).items()) for s in shapes]
    (args.out_dir / f"{stem}.json").write_text(
        json.dumps(dict(environment=env, dtype=args.dtype, shapes=shape_info, results=rows),
                   indent=2, default=str) + "\n"
    )
    table = _markdown(env, shapes, rows)
    (args.out_dir / f"{stem}.md").write_text(table + "\n")
    print(f"wrote {args.out_dir / stem}.json and .md", file=sys.stderr)
    print(table)
    ok = all(r.get("status") == "ok" or str(r.get("status", "")).startswith("unavailable")
             for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
