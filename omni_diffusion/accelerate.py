"""``accelerate(pipe, config)``: omni's kernels, quantization, caching and compilation
on a diffusers pipeline in one call, and ``undo(pipe)`` to take them off again.

::

    import omni_diffusion as od

    pipe = od.accelerate(pipe, od.AccelConfig(attention="auto", quant="fp8",
                                              cache=od.CacheConfig("first_block"), compile=True))
    image = pipe(prompt).images[0]
    od.last_cache_stats(pipe)          # hits of that call (also pipe.omni_stats)
    od.undo(pipe)                      # back to the original modules

Each feature is one object or function that changes the pipeline and returns its undo,
applied to every denoiser the family's adapter (:mod:`omni_diffusion.adapters`) names, in
this order: parallelism's weight sharding, ``quant``
(:func:`omni_diffusion.quantization.apply_quantization`), fused QK-norm + RoPE, ``attention``,
``cache`` (:mod:`omni_diffusion.cache`), the attention policy, sequence parallelism,
``compile`` (:mod:`omni_diffusion.compile`, at the first call) and the prompt stage.

When caching, progress or a prompt stage is asked for, the pipeline's class is swapped for a
subclass of the same name whose ``__call__`` opens a fresh cache state per call (isolated
between concurrent calls), reports progress and stores the call's
:class:`~omni_diffusion.cache.CacheStats` as ``pipe.omni_stats``.

:func:`undo` restores exactly what was there (the same module objects, no compiled regions,
no hooks, the pipeline's own class). :func:`accelerate` on an accelerated pipeline undoes the
previous configuration first: it never stacks.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from omni_diffusion.adapters import ModelAdapter, adapter_for, adapter_for_transformer
from omni_diffusion.cache.state import CacheStats, generation
from omni_diffusion.compile import apply_compile, mark_graph_steps
from omni_diffusion.config import ATTENTION_AUTO, AccelConfig
from omni_diffusion.quantization import apply_quantization

logger = logging.getLogger("omni_diffusion.accelerate")

#: ``progress(step, total, latents)``: step counts completed steps (1..total)
ProgressFn = Callable[[int, "int | None", "torch.Tensor | None"], Any]

_STATE_ATTR = "_omni_accel"
_OWNER_ATTR = "_omni_accelerated_by"


@dataclasses.dataclass
class _Accelerated:
    config: AccelConfig
    adapter: ModelAdapter
    progress: ProgressFn | None
    wraps_call: bool = False
    #: the LLM prompt stage (omni_diffusion.ar.stage.PromptStage), when configured
    prompt_stage: Any = None
    undos: list[tuple[str, Callable[[], None]]] = dataclasses.field(default_factory=list)
    transformers: dict[str, nn.Module] = dataclasses.field(default_factory=dict)

    @property
    def cache_kind(self) -> str | None:
        return None if self.config.cache is None else self.config.cache.kind

    def run_undos(self) -> None:
        errors = []
        while self.undos:
            what, fn = self.undos.pop()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - undo everything, report after
                errors.append(f"{what}: {type(exc).__name__}: {exc}")
        if errors:
            raise RuntimeError("undo failed for " + "; ".join(errors))


# --------------------------------------------------------------------------- public


def accelerate(
    pipe: Any,
    config: AccelConfig | Mapping[str, Any] | None = None,
    *,
    progress: ProgressFn | None = None,
    adapter: ModelAdapter | None = None,
) -> Any:
    """Apply ``config`` to ``pipe`` in place and return ``pipe``.

    Args:
        pipe: a diffusers pipeline of a supported family, or a bare transformer
            of one (then caching works inside ``omni_diffusion.cache.generation()``
            blocks the caller opens, and ``progress`` is not available).
        config: an :class:`AccelConfig`, a dict of its fields, or None for
            ``AccelConfig()`` (omni attention ``"auto"`` only).
        progress: called as ``progress(step, total, latents)`` after every
            denoising step of every call (through the pipeline's
            ``callback_on_step_end``, composed with one the caller passes).
        adapter: overrides the registry's choice of model adapter.

    Raises:
        ValueError: unsupported pipeline (the message lists the supported
            ones), a config the model cannot take, a transformer shared with
            another accelerated pipeline.
        ImportError: ``cache="cache_dit"`` without the cache-dit package.
    """
    if config is None:
        config = AccelConfig()
    elif isinstance(config, Mapping):
        config = AccelConfig.from_dict(config)
    elif not isinstance(config, AccelConfig):
        raise TypeError(f"config must be an AccelConfig or a dict, not {type(config).__name__}")
    if is_accelerated(pipe):
        undo(pipe)
    if isinstance(pipe, nn.Module):  # a bare transformer (custom loops, benchmarks)
        if progress is not None:
            raise ValueError("progress needs a pipeline: it reports through callback_on_step_end")
        if config.cache is not None and config.cache.kind == "cache_dit":
            raise ValueError("cache='cache_dit' needs a pipeline, not a bare transformer")
        adapter = adapter or adapter_for_transformer(pipe)
        transformers = {"transformer": pipe}
    else:
        adapter = adapter or adapter_for(pipe)
        transformers = adapter.transformers(pipe)
    for name, transformer in transformers.items():
        owner_ref = transformer.__dict__.get(_OWNER_ATTR)
        owner = owner_ref() if owner_ref is not None else None
        if owner is not None and owner is not pipe:
            raise ValueError(
                f"pipe.{name} is already accelerated through another pipeline "
                f"({type(owner).__name__}); undo() that pipeline first"
            )
    state = _Accelerated(config=config, adapter=adapter, progress=progress,
                         transformers=dict(transformers))
    try:
        _apply(pipe, state)
    except BaseException:
        state.run_undos()
        raise
    pipe.__dict__[_STATE_ATTR] = state
    return pipe


def undo(pipe: Any) -> Any:
    """Take omni's acceleration off ``pipe`` (no-op when it has none); returns ``pipe``."""
    state = pipe.__dict__.pop(_STATE_ATTR, None)
    if state is not None:
        state.run_undos()
        pipe.__dict__.pop("omni_stats", None)
    return pipe


def is_accelerated(pipe: Any) -> bool:
    return _STATE_ATTR in getattr(pipe, "__dict__", {})


def accel_config(pipe: Any) -> AccelConfig | None:
    """The :class:`AccelConfig` applied to ``pipe``, or None."""
    state = getattr(pipe, "__dict__", {}).get(_STATE_ATTR)
    return None if state is None else state.config


def prompt_stage_of(pipe: Any) -> Any:
    """The LLM prompt stage (:class:`omni_diffusion.ar.stage.PromptStage`) that
    :func:`accelerate` gave ``pipe``, or None; its ``encoder.stats`` count the encoder's
    batches (a server exports them)."""
    state = getattr(pipe, "__dict__", {}).get(_STATE_ATTR)
    return None if state is None else state.prompt_stage


def last_cache_stats(pipe: Any) -> CacheStats | None:
    """The :class:`~omni_diffusion.cache.CacheStats` of ``pipe``'s last finished
    call (also ``pipe.omni_stats``); None before the first call or without
    caching. With concurrent calls, use :func:`omni_diffusion.collect_stats`."""
    return getattr(pipe, "__dict__", {}).get("omni_stats")


def step_callback(progress: ProgressFn, callback: Callable | None = None) -> Callable:
    """A diffusers ``callback_on_step_end`` that calls ``progress(step, total, latents)``
    and then ``callback`` (if given), for per-request progress in a server::

        pipe(prompt, callback_on_step_end=omni_diffusion.step_callback(report))
    """

    def on_step_end(pipeline, step: int, timestep, callback_kwargs: dict):
        total = getattr(pipeline, "_num_timesteps", None)
        progress(step + 1, total, callback_kwargs.get("latents"))
        if callback is not None:
            result = callback(pipeline, step, timestep, callback_kwargs)
            return callback_kwargs if result is None else result
        return callback_kwargs

    tensor_inputs = getattr(callback, "tensor_inputs", None)
    if tensor_inputs is not None:
        on_step_end.tensor_inputs = list(tensor_inputs)
    return on_step_end


# --------------------------------------------------------------------------- applying


def _apply(pipe: Any, state: _Accelerated) -> None:
    config, adapter = state.config, state.adapter
    runtime = None
    if config.attention not in (None, ATTENTION_AUTO):  # checked before anything is changed
        _check_attention_device(config.attention, state.transformers)
    if config.parallel is not None:  # validated before any collective, then the mesh is built
        from omni_diffusion.parallel import prepare

        runtime = prepare(pipe, config.parallel, adapter, state.transformers)
        # tensor parallelism shards the float weights, before quantization
        state.undos.append(("parallel weights", runtime.shard_weights()))
    if config.cuda_graphs:  # checked before anything is changed
        for name, transformer in state.transformers.items():
            device = _module_device(transformer)
            if device is None or device.type != "cuda":
                raise ValueError(
                    f"AccelConfig.cuda_graphs: True needs the pipeline on a CUDA device; "
                    f"{name} is on {device}"
                )
    for name, transformer in state.transformers.items():
        transformer.__dict__[_OWNER_ATTR] = weakref.ref(pipe)
        state.undos.append((f"{name} owner", functools.partial(
            transformer.__dict__.pop, _OWNER_ATTR, None)))
        if config.quant is not None:
            state.undos.append((f"{name} quantization", apply_quantization(transformer, adapter, config)))
        if _wants_fused_norm_rope(name, transformer, adapter, config):
            state.undos.append((f"{name} fused norm+RoPE", adapter.apply_fused_norm_rope(transformer)))
        if config.attention is not None:
            backend = None if config.attention == ATTENTION_AUTO else config.attention
            state.undos.append((f"{name} attention", adapter.apply_attention(transformer, backend)))
        if config.cache is not None and config.cache.kind != "cache_dit":
            from omni_diffusion.cache.hooks import CacheController

            controller = CacheController(name, transformer, adapter, config.cache, pipe=pipe,
                                         clone_kept_outputs=config.cuda_graphs)
            controller.install()
            state.undos.append((f"{name} cache", controller.remove))
    if config.cache is not None and config.cache.kind == "cache_dit":
        from omni_diffusion.cache import cache_dit

        warmup = 1 if config.cache.warmup_steps is None else config.cache.warmup_steps
        state.undos.append(("cache-dit", cache_dit.enable(pipe, config.cache, adapter.cfg.mode, warmup)))
    if config.attention_policy is not None:
        from omni_diffusion.attention.policy import apply_attention_policy

        scheduler = None if isinstance(pipe, nn.Module) else getattr(pipe, "scheduler", None)
        for name, transformer in state.transformers.items():
            handle = apply_attention_policy(transformer, config.attention_policy, scheduler=scheduler)
            state.undos.append((f"{name} attention policy", handle.remove))
    if runtime is not None:  # sequence-parallel attention wraps the backend installed above
        backend = None if config.attention in (None, ATTENTION_AUTO) else config.attention
        state.undos.append(("parallel", runtime.install(backend)))
    if config.compile:
        for name, transformer in state.transformers.items():
            state.undos.append((f"{name} compile", apply_compile(transformer, adapter, config)))
            if config.cuda_graphs:
                state.undos.append((f"{name} CUDA-graph steps", mark_graph_steps(transformer)))
    if config.prompt_encoder is not None or config.prompt_enhancer is not None:
        if isinstance(pipe, nn.Module):
            raise ValueError("prompt_encoder/prompt_enhancer need a pipeline, not a bare transformer")
        from omni_diffusion.ar.stage import PromptStage

        state.prompt_stage = PromptStage(pipe, adapter, config.prompt_encoder, config.prompt_enhancer)
        state.undos.append(("prompt stage", state.prompt_stage.close))
    if (config.cache is not None or state.progress is not None or state.prompt_stage is not None) \
            and not isinstance(pipe, nn.Module):
        state.undos.append(("pipeline __call__", _wrap_call(pipe, state)))


def _check_attention_device(backend: str, transformers: dict[str, nn.Module]) -> None:
    """Raise ``ValueError`` when ``backend`` cannot run on the device of a transformer
    (known from its weights), rather than at the pipeline's first call."""
    from omni_kernels.attention import backend_status

    for name, transformer in transformers.items():
        device = _module_device(transformer)
        if device is None or device.type == "meta":
            continue
        status = backend_status(device)
        if status.get(backend) is not None:
            usable = [ATTENTION_AUTO, *(b for b, reason in status.items() if reason is None), None]
            raise ValueError(f"AccelConfig.attention: {backend!r} cannot run on {name}'s device {device}: "
                             f"{status[backend]}; allowed there: {', '.join(map(repr, usable))}")


def _wants_fused_norm_rope(name: str, transformer: nn.Module, adapter: ModelAdapter, config: AccelConfig) -> bool:
    """``config.fused_norm_rope`` resolved: None is on where the family has the processor and
    ``transformer`` is on CUDA (omni's kernels; elsewhere they fall back to torch ops)."""
    if config.fused_norm_rope is not None:
        return config.fused_norm_rope  # True on a family without one raises in apply_fused_norm_rope
    device = _module_device(transformer)
    chosen = adapter.has_fused_norm_rope and device is not None and device.type == "cuda"
    logger.info("accelerate: fused_norm_rope=auto -> %s for %s (%s adapter%s, on %s)", chosen, name, adapter.name,
                "" if adapter.has_fused_norm_rope else " has no fused processor", device)
    return chosen


def _module_device(module: nn.Module) -> torch.device | None:
    for tensor in module.parameters():
        return tensor.device
    return None


# --------------------------------------------------------------------------- pipeline call

_CALL_CLASSES: dict[type, type] = {}


def _accelerated_class(base: type) -> type:
    cls = _CALL_CLASSES.get(base)
    if cls is not None:
        return cls
    original_call = base.__call__

    @functools.wraps(original_call)
    def __call__(self, *args, **kwargs):
        return _call(self, original_call, args, kwargs)

    cls = type(base.__name__, (base,), {
        "__call__": __call__,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "_omni_base_class": base,
    })
    _CALL_CLASSES[base] = cls
    return cls


def _wrap_call(pipe: Any, state: _Accelerated):
    base = type(pipe)
    object.__setattr__(pipe, "__class__", _accelerated_class(base))
    state.wraps_call = True

    def undo() -> None:
        object.__setattr__(pipe, "__class__", base)

    return undo


def _call(pipe: Any, original_call: Callable, args: tuple, kwargs: dict):
    state: _Accelerated | None = pipe.__dict__.get(_STATE_ATTR)
    if state is None:
        return original_call(pipe, *args, **kwargs)
    if state.progress is not None:
        kwargs = _with_progress(pipe, original_call, kwargs, state.progress)
    if state.prompt_stage is not None:
        # prompts may come positionally: bind them to their names first
        signature = inspect.signature(original_call)
        bound = signature.bind_partial(pipe, *args, **kwargs)
        args, kwargs = (), {}
        for index, (name, value) in enumerate(bound.arguments.items()):
            if index == 0:
                continue  # the pipeline itself
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                kwargs.update(value)
            else:
                kwargs[name] = value
        kwargs = state.prompt_stage.prepare(pipe, kwargs)
    kind = state.cache_kind
    opened = None
    try:
        with generation(pipe, kind=kind) as gen:
            opened = gen
            try:
                return original_call(pipe, *args, **kwargs)
            finally:
                if kind == "cache_dit":
                    from omni_diffusion.cache import cache_dit

                    gen.extra["cache_dit"] = {"summary": cache_dit.summary(pipe)}
    finally:
        if opened is not None and opened.final_stats is not None:
            pipe.__dict__["omni_stats"] = opened.final_stats


_WARNED_NO_CALLBACK: set[type] = set()


def _with_progress(pipe: Any, original_call: Callable, kwargs: dict, progress: ProgressFn) -> dict:
    params = inspect.signature(original_call).parameters
    if "callback_on_step_end" not in params:
        if type(pipe) not in _WARNED_NO_CALLBACK:
            _WARNED_NO_CALLBACK.add(type(pipe))
            logger.warning("%s has no callback_on_step_end: no progress reports", type(pipe).__name__)
        return kwargs
    kwargs = dict(kwargs)
    user = kwargs.get("callback_on_step_end")
    callback = step_callback(progress, user)
    kwargs["callback_on_step_end"] = callback
    tensor_inputs = getattr(callback, "tensor_inputs", None)
    if tensor_inputs is not None and "callback_on_step_end_tensor_inputs" in params:
        kwargs["callback_on_step_end_tensor_inputs"] = tensor_inputs
    return kwargs


__all__ = [
    "accel_config",
    "accelerate",
    "is_accelerated",
    "last_cache_stats",
    "step_callback",
    "undo",
]
