#!/usr/bin/env python3
"""Multi-GPU scaling of a transformer forward / a true-CFG step under omni's parallel strategies (torchrun).

One process per GPU (NCCL; gloo on CPU for ``--smoke``). Every rank builds the same
random-weight transformer of ``bench/pipeline.py`` (``flux``: FLUX.1-dev shape at 1024²;
``wan``: Wan2.1-14B shape at 480p/81 frames; ``--smoke``: tiny CPU versions) and the same
inputs. Rank 0 first times the plain model on its own GPU (the 1-GPU baseline) while the other
ranks wait; then each strategy is applied on every rank with ``omni_diffusion.accelerate(model,
AccelConfig(..., parallel=ParallelConfig(...)))``, timed on all ranks together, and undone:
``ulysses`` (``ulysses=N``), ``ring`` (``ring=N``), ``usp`` (``ulysses=2, ring=N/2``), ``tp``
(``tp=N``: attention projections and MLPs sharded), ``cfg`` (``cfg=2``, N = 2) and
``cfg_ulysses`` (``cfg=2, ulysses=N/2``).

The first four time one transformer forward against rank 0's plain forward. The two CFG
strategies time one true-CFG step (a conditional and an unconditional call on the same latents,
combined as ``uncond + scale * (cond - uncond)``) against rank 0's plain step. omni splits the
two calls over ranks by wrapping the *pipeline's* ``__call__`` (``accelerate`` refuses
``cfg > 1`` on a bare transformer), so :class:`TrueCFGStep` is the smallest such pipeline: it
holds the transformer and both branches' inputs and takes the arguments the family's
``CFGInfo`` names. The stack (``--attention``, ``--compile``, ``--quant fp8|int8``) is the same
for the baselines and every strategy; without ``--compile`` a Flux-sized model is bound by each
rank's kernel launches, so eager scaling understates what the stack reaches.

Per strategy: the median time over ``--iters`` after ``--warmup`` (the slowest rank's), the
speed-up and scaling efficiency (speed-up / N) against its baseline, each rank's peak memory,
and the relative error of rank 0's output against the baseline's. Record (rank 0):
``parallel_scaling_<model>_x<N>_<device>_<date>.json`` and ``.md`` in ``--out-dir``; the table
is printed.

    torchrun --nproc_per_node 2 bench/parallel_scaling.py --model flux
    torchrun --nproc_per_node 8 bench/parallel_scaling.py --model wan --compile --quant fp8
    torchrun --nproc_per_node 2 bench/parallel_scaling.py --smoke --model flux   # CPU check
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __package__:  # imported as bench.<script> (the tests)
    from bench import harness, pipeline, pipeline_models
    from bench import shapes as models
else:  # run as python3 bench/<script>.py: bench/ itself is on sys.path
    import harness
    import pipeline
    import pipeline_models
    import shapes as models


#: bench/pipeline.py's models plus the sizes issue 11 scales: Flux at 2048x2048 and Wan at 720p
SCALING_MODELS = {
    **pipeline_models.MODELS,
    "flux-2048": dataclasses.replace(
        pipeline_models.MODELS["flux"], key="flux-2048", name="flux1-dev-2048",
        description="FLUX.1-dev shape, 2048x2048: 16384 image + 512 text tokens, 24 heads x 128, "
                    "19 + 38 blocks, guidance-distilled (1 forward / step)",
        warmup=2, iters=5, attention=(1, 24, 16896, 16896, 128), sizes=dict(side=128, text=512),
    ),
    "wan-720p": dataclasses.replace(
        pipeline_models.MODELS["wan"], key="wan-720p", name="wan2.1-14b-720p-81f",
        description="Wan2.1-T2V-14B shape, 720x1280, 81 frames: 75,600 video tokens, 40 heads x 128, "
                    "40 blocks, 512 text tokens, CFG (2 forwards / step)",
        warmup=1, iters=3, attention=models.WAN_720P.self_attention(),
        sizes=dict(frames=21, height=90, width=160, text=512),
    ),
}
SMOKE_SCALING_MODELS = {**pipeline_models.SMOKE_MODELS, "flux-2048": pipeline_models.SMOKE_MODELS["flux"], "wan-720p": pipeline_models.SMOKE_MODELS["wan"]}

STRATEGIES = ("ulysses", "ring", "usp", "tp", "cfg", "cfg_ulysses")
#: strategies timed as a true-CFG step (two transformer calls) against the CFG-step baseline
CFG_STRATEGIES = ("cfg", "cfg_ulysses")
#: what a strategy needs of the world size when it does not apply (the skipped row's reason)
_WORLD_NEEDS = {
    "usp": "an even world size >= 4",
    "cfg": "exactly 2 ranks (cfg degree 2, one rank per guidance branch; cfg_ulysses uses more)",
    "cfg_ulysses": "an even world size >= 4",
}
#: the guidance scale of the CFG step (any value > 1 turns the unconditional call on)
CFG_SCALE = 4.0
#: transformer inputs that carry the prompt: the unconditional branch gets the negative prompt's
NEGATIVE_PROMPT_INPUTS = ("encoder_hidden_states", "pooled_projections")


def parallel_config_for(strategy: str, world: int):
    """The ParallelConfig of ``strategy`` on ``world`` ranks, or None when it does not apply."""
    from omni_diffusion.parallel import ParallelConfig

    if strategy == "ulysses":
        return ParallelConfig(ulysses=world)
    if strategy == "ring":
        return ParallelConfig(ring=world)
    if strategy == "usp":
        return ParallelConfig(ulysses=2, ring=world // 2) if world >= 4 and world % 2 == 0 else None
    if strategy == "tp":
        return ParallelConfig(tp=world)
    if strategy == "cfg":
        return ParallelConfig(cfg=2) if world == 2 else None
    if strategy == "cfg_ulysses":
        return ParallelConfig(cfg=2, ulysses=world // 2) if world >= 4 and world % 2 == 0 else None
    raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}")


class TrueCFGStep:
    """One true-CFG denoising step of ``transformer``: a pipeline in miniature for omni's CFG parallelism.

    ``conditional`` / ``unconditional`` are the transformer's keyword inputs of the two branches
    (same latents, timestep and positions; the prompt's or the negative prompt's embeddings,
    same shapes; ``return_dict=False``). A call runs the conditional branch, then the
    unconditional one, and returns ``(uncond + scale * (cond - uncond),)``: the guided noise
    prediction, the shape and dtype of the transformer's output (Flux ``[B, S, C]``, Wan
    ``[B, C, F, H, W]``). Build it with :func:`true_cfg_step`, which gives the call the
    keyword arguments the family's ``CFGInfo`` names, so that omni's CFG runtime reads them
    as from a real pipeline call.
    """

    def __init__(self, transformer: torch.nn.Module, conditional: dict, unconditional: dict) -> None:
        self.transformer = transformer
        self.conditional, self.unconditional = conditional, unconditional

    def guided(self, scale: float) -> tuple[torch.Tensor]:
        cond = self._branch(self.conditional)
        uncond = self._branch(self.unconditional)
        return (uncond + scale * (cond - uncond),)

    def _branch(self, inputs: dict) -> torch.Tensor:
        out = self.transformer(**inputs)
        return out[0] if isinstance(out, (tuple, list)) else out.sample


def true_cfg_step(transformer: torch.nn.Module, conditional: dict, unconditional: dict,
                  scale: float = CFG_SCALE) -> tuple[TrueCFGStep, dict]:
    """A :class:`TrueCFGStep` for ``transformer``'s family, and the keyword arguments of its call.

    The call's signature is the family's guidance-scale argument (Flux ``true_cfg_scale``,
    Wan ``guidance_scale``) and its negative-prompt arguments, all keyword-only: omni's CFG
    parallelism binds a pipeline call to its signature to learn whether the unconditional
    branch runs. The returned arguments set the scale to ``scale`` and each negative-prompt
    argument to a marker string (the negative embeddings are already in ``unconditional``).
    """
    from omni_diffusion.adapters import adapter_for_transformer

    adapter = adapter_for_transformer(transformer)
    scale_argument = adapter.cfg.guidance_scale_argument
    if scale_argument is None:
        raise ValueError(f"transformer: the {adapter.name} family has no true-CFG argument "
                         "(its guidance is distilled into one call); a CFG step needs one")
    names = (scale_argument, *adapter.cfg.negative_arguments)

    def __call__(self, **arguments):
        return self.guided(float(arguments[scale_argument]))

    __call__.__signature__ = inspect.Signature([
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in names),
    ])
    cls = type(f"TrueCFGStep_{adapter.name}", (TrueCFGStep,), {"__call__": __call__})
    arguments = {scale_argument: scale, **{name: "negative prompt (pre-encoded)"
                                           for name in adapter.cfg.negative_arguments}}
    return cls(transformer, conditional, unconditional), arguments


class ForwardCounter:
    """Counts the forwards ``transformer`` computes on this rank, as its instance ``forward``.

    Installed before any ``accelerate``, it sits below omni's CFG wrapper (which captures the
    instance forward it finds and calls it only for the branch this rank computes), so a count
    over one step says how the branches were split: 2 for the plain CFG step, 1 per rank under
    ``cfg=2``. One Python call per forward, the same for baselines and strategies.
    """

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.calls = 0
        self._forward = transformer.forward
        transformer.forward = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._forward(*args, **kwargs)


def negative_inputs(inputs: dict, seed: int = 2) -> dict:
    """``inputs`` with the prompt inputs (:data:`NEGATIVE_PROMPT_INPUTS`) replaced by seeded
    random tensors of the same shape, dtype and device: the negative prompt's embeddings."""
    gen = None
    negative = dict(inputs)
    for name in NEGATIVE_PROMPT_INPUTS:
        value = inputs.get(name)
        if isinstance(value, torch.Tensor):
            if gen is None:
                gen = torch.Generator(device=value.device).manual_seed(seed)
            negative[name] = torch.randn(value.shape, generator=gen, device=value.device,
                                         dtype=torch.float32).to(value.dtype)
    if gen is None:
        raise ValueError(f"inputs: none of {NEGATIVE_PROMPT_INPUTS} to give a negative prompt; "
                         f"got {sorted(inputs)}")
    return negative


def _measures(strategy: str) -> str:
    """``"cfg_step"`` for the CFG strategies, ``"forward"`` for the others (the row's baseline)."""
    return "cfg_step" if strategy in CFG_STRATEGIES else "forward"


def _median_ms(model, inputs, warmup: int, iters: int, device: torch.device) -> tuple[float, torch.Tensor]:
    timing, out = pipeline.time_variant(model, inputs, warmup, iters, device)
    return timing["forward_ms"], out


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SCALING_MODELS), default="flux")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--attention", default="auto", help="omni attention backend for every run")
    parser.add_argument("--warmup", type=int, default=None, help="default: the model's (bench/pipeline.py)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="regional torch.compile of the blocks (every run)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend with --compile")
    parser.add_argument("--quant", choices=("fp8", "int8"), default=None, help="W8A8 linear layers (every run)")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU with gloo")
    harness.add_out_dir_argument(parser, __file__)
    return parser.parse_args(argv)


def _stack_words(args) -> str:
    parts = [f"attention {args.attention}"]
    if args.compile:
        parts.append(f"regional compile ({args.compile_backend})")
    if args.quant:
        parts.append(f"{args.quant} W8A8 linears")
    return ", ".join(parts) if args.compile or args.quant else f"{parts[0]}, eager"


#: what a row measures -> its label in the markdown (each row's baseline is the same thing on rank 0 alone)
MEASURES = {"forward": "forward", "cfg_step": "CFG step (cond + uncond)"}


def _markdown(env: dict, spec, world: int, baselines: dict, baseline_forwards: dict, rows: list[dict],
              stack: str) -> str:
    """``baselines``: ``{"forward" | "cfg_step": rank 0's plain ms}`` (only those some row used);
    ``baseline_forwards``: the transformer forwards each of those computes."""
    described = {
        "forward": "one transformer forward",
        "cfg_step": "one true-CFG step: the conditional and the unconditional transformer call "
                    f"(the negative prompt's embeddings), combined with scale {CFG_SCALE}",
    }
    said = "; ".join(f"{MEASURES[k]} = {described[k]}: {ms:.2f} ms ({baseline_forwards[k]} "
                     f"transformer forward{'' if baseline_forwards[k] == 1 else 's'})"
                     for k, ms in baselines.items())
    device = env.get("device")
    lines = [
        f"# Parallel scaling: {spec.name} on {world} x {device if device not in (None, 'none') else 'CPU (gloo)'}",
        "",
        f"commit {env.get('git_commit')}, torch {env.get('torch')}, {env.get('utc')}; "
        f"command: `{env.get('command')}`",
        "",
        f"{spec.description}. Stack (every run): {stack}. Each row is timed against the same work "
        f"on rank 0 alone (plain, same stack), named in its \"measures\" column: {said}.",
        "",
        "| strategy | config | measures (and baseline) | ms (slowest rank) | speed-up | efficiency "
        "| forwards per rank | peak GiB per rank | rel err | status |",
        "| --- | --- | --- | ---: | ---: | ---: | --- | --- | ---: | --- |",
    ]
    for r in rows:
        measures = MEASURES[r["measures"]]
        if r["status"] != "ok":
            lines.append(f"| {r['strategy']} | {r.get('config', '-')} | {measures} | - | - | - | - | - | - "
                         f"| {r['status']} |")
            continue
        peaks = ", ".join("-" if p is None else f"{p:.1f}" for p in r["peak_gib"])
        lines.append(
            f"| {r['strategy']} | {r['config']} | {measures} | {r['ms']:.2f} | {r['speedup']:.2f}x | "
            f"{r['efficiency']:.0%} | {', '.join(map(str, r['forwards_per_rank']))} | {peaks} | "
            f"{r['rel_err']:.1e} | ok |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun, e.g. torchrun --nproc_per_node 2 bench/parallel_scaling.py", file=sys.stderr)
        return 2
    device = harness.init_torchrun_process_group(cpu=args.smoke)
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = (SMOKE_SCALING_MODELS if args.smoke else SCALING_MODELS)[args.model]
    dtype = torch.bfloat16 if cuda else torch.float32
    warmup = spec.warmup if args.warmup is None else args.warmup
    iters = spec.iters if args.iters is None else args.iters

    import omni_diffusion as od
    model = pipeline_models.build_transformer(spec, device, dtype)
    inputs = pipeline_models.make_inputs(spec, device, dtype)
    stack = dict(attention=args.attention, compile=args.compile, compile_backend=args.compile_backend,
                 quant=args.quant)
    if args.quant and device.type == "cpu":  # the smoke test: torch's CPU ops, not the interpreter
        stack["quant_options"] = {"activation_backend": "torch"}
    # What each kind of row runs: the bare transformer on one branch's inputs, or the CFG step
    # (accelerated as a whole: the stack and the parallel config reach its transformer).
    work = {"forward": (model, inputs)}
    if any(s in CFG_STRATEGIES for s in args.strategies):
        work["cfg_step"] = true_cfg_step(model, inputs, negative_inputs(inputs))
    planned = [(s, parallel_config_for(s, world)) for s in args.strategies]
    needed = [kind for kind in work
              if any(c is not None and _measures(s) == kind for s, c in planned)]
    counter = ForwardCounter(model)

    def forwards_per_call(target, call_inputs) -> int:
        """Transformer forwards this rank computes in one more (untimed) call of ``target``."""
        counter.calls = 0
        pipeline_models.forward_once(target, call_inputs)
        return counter.calls

    baselines: dict[str, float] = {}
    references: dict[str, torch.Tensor] = {}
    baseline_forwards: dict[str, int] = {}
    if rank == 0:
        for kind in needed:
            target, call_inputs = work[kind]
            od.accelerate(target, od.AccelConfig(**stack))
            try:
                baselines[kind], references[kind] = _median_ms(target, call_inputs, warmup, iters, device)
                baseline_forwards[kind] = forwards_per_call(target, call_inputs)
            finally:
                od.undo(target)
            print(f"[rank 0] plain {MEASURES[kind]} {baselines[kind]:.2f} ms "
                  f"({baseline_forwards[kind]} transformer forward(s))", flush=True)
    dist.barrier()

    rows = []
    for strategy, config in planned:
        measures = _measures(strategy)
        if config is None:
            rows.append(dict(strategy=strategy, measures=measures,
                             status=f"skipped: needs {_WORLD_NEEDS[strategy]}, got {world}"))
            continue
        described = ", ".join(f"{k}={v}" for k, v in vars(config).items() if isinstance(v, int) and v > 1)
        target, call_inputs = work[measures]
        try:
            od.accelerate(target, od.AccelConfig(**stack, parallel=config))
        except ValueError as error:  # raised before any collective, the same on every rank
            rows.append(dict(strategy=strategy, measures=measures, config=described, status=f"refused: {error}"))
            continue
        try:
            _reset_peak(device)
            ms, out = _median_ms(target, call_inputs, warmup, iters, device)
            times = harness.gather_from_ranks(ms, world)
            peaks = harness.gather_from_ranks(_peak_gib(device), world)
            forwards = harness.gather_from_ranks(forwards_per_call(target, call_inputs), world)
        finally:
            od.undo(target)
            dist.barrier()
        if rank == 0:
            slowest = max(t for t in times if t is not None)
            rel = pipeline.relative_error(out, references[measures])
            speedup = baselines[measures] / slowest
            rows.append(dict(strategy=strategy, measures=measures, config=described, status="ok",
                             ms=round(slowest, 3), baseline_ms=round(baselines[measures], 3), rank_ms=times,
                             speedup=round(speedup, 3), efficiency=round(speedup / world, 3),
                             peak_gib=peaks, rel_err=rel, forwards_per_rank=forwards))
            print(f"[rank 0] {strategy} ({described}, {MEASURES[measures]}): {slowest:.2f} ms, {speedup:.2f}x, "
                  f"efficiency {speedup / world:.0%}, rel err {rel:.1e}", flush=True)

    if rank == 0:
        env = harness.base_environment()
        tags = ("-smoke" if args.smoke else "") + ("-compile" if args.compile else "") + (f"-{args.quant}" if args.quant else "")
        stem = harness.record_stem(f"parallel_scaling_{spec.key}{tags}_x{world}",
                                   torch.cuda.get_device_name(device) if cuda else "cpu")
        record = dict(benchmark="parallel_scaling", environment=env, model=spec.name, world_size=world,
                      baseline_ms=baselines.get("forward"), cfg_step_baseline_ms=baselines.get("cfg_step"),
                      baseline_forwards=baseline_forwards, cfg_scale=CFG_SCALE, rows=rows,
                      args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
        md = _markdown(env, spec, world, baselines, baseline_forwards, rows, _stack_words(args))
        harness.write_record(args.out_dir, stem, record, md)
        print(md)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
