"""CFG parallelism: the conditional and unconditional branches on different ranks.

Two ways, from the adapter's :class:`~omni_diffusion.adapters.base.CFGInfo`:

* ``"batched"`` (SD3: both branches concatenated along the batch in one
  transformer call): a forward pre-hook gives CFG rank ``c`` its part of the
  batch (``torch.tensor_split`` of every input whose first dimension is the
  batch), a forward hook all-gathers the outputs along the batch. A batch
  smaller than the degree is computed whole on every rank.
* ``"separate"`` (Wan, Qwen-Image, Flux/HunyuanVideo true CFG: one call per
  branch, conditional first): the pipeline's ``__call__`` is wrapped to learn,
  from its arguments, whether the unconditional calls will happen (the
  adapter's ``guidance_scale_argument`` above 1 and, where declared, a
  negative prompt). If so, on each step's conditional call rank 0 computes and
  rank 1 returns an empty output buffer at once; on the unconditional call rank
  1 computes, rank 0 does not, and one all-gather gives both ranks both
  results: rank 1 fills the buffer it returned before (the pipeline holds it
  and combines only after the second call), rank 0 returns rank 1's result.
  The buffer's shape is learnt from a real conditional call the first time an
  input shape is seen (rank 1 then computes that one call itself). The
  unconditional call's inputs may differ in shape from the conditional one's
  (Qwen-Image encodes the negative prompt to its own length); its output has
  the conditional output's shape (both are the noise prediction for the same
  latents). Without CFG every rank computes every call.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch
from torch import nn

from omni_diffusion.adapters.base import ModelAdapter
from omni_diffusion.parallel.comm import all_gather_uneven
from omni_diffusion.parallel.config import offsets, split_sizes

_STATE_ATTR = "_omni_cfg_parallel"


def check_cfg_parallel(adapter: ModelAdapter, pipe: Any) -> str:
    """The CFG-parallel kind for ``adapter`` (``"batched"`` / ``"separate"``);
    ``ValueError`` when the family has no separate branches to split."""
    mode = adapter.cfg.mode
    if mode == "batched":
        return "batched"
    if mode == "separate" or adapter.cfg.guidance_scale_argument is not None:
        if isinstance(pipe, nn.Module):
            raise ValueError(f"cfg parallelism for the {adapter.name} family (separate "
                             "conditional/unconditional calls) needs the pipeline, not a bare transformer")
        return "separate"
    raise ValueError(f"cfg parallelism is not available for the {adapter.name} family: its guidance "
                     "is distilled into one call and it has no true-CFG argument")


# --------------------------------------------------------------------------- batched


def _output_tensor(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output.sample


def _with_tensor(output: Any, tensor: torch.Tensor) -> Any:
    if isinstance(output, tuple):
        return (tensor, *output[1:])
    return dataclasses.replace(output, sample=tensor) if dataclasses.is_dataclass(output) \
        else type(output)(sample=tensor)


def _enable_batched(transformer: nn.Module, group, rank: int, size: int):
    split: dict[str, Any] = {}

    def before(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        batch = hidden.shape[0]
        split["sizes"] = None
        if batch < size:
            return None
        sizes = split_sizes(batch, size)
        start = offsets(sizes)[rank]
        split["sizes"] = sizes

        def cut(x):
            if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch:
                return x.narrow(0, start, sizes[rank])
            return x

        return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}

    def after(module, args, kwargs, output):
        sizes = split.get("sizes")
        if sizes is None:
            return output
        return _with_tensor(output, all_gather_uneven(_output_tensor(output), sizes, 0, group))

    handles = [transformer.register_forward_pre_hook(before, with_kwargs=True),
               transformer.register_forward_hook(after, with_kwargs=True)]
    return lambda: [h.remove() for h in handles]


# --------------------------------------------------------------------------- separate


@dataclasses.dataclass
class _CallState:
    active: bool = False
    calls: int = 0
    cond: torch.Tensor | None = None
    cond_output: Any = None  # rank 0: this step's conditional output, to rebuild from
    pending: torch.Tensor | None = None
    # input shapes -> (output shape, dtype, an output of that kind to rebuild from)
    known: dict = dataclasses.field(default_factory=dict)


def _signature(args: tuple, kwargs: dict) -> tuple:
    return tuple(
        (k, tuple(v.shape), v.dtype) for k, v in [*enumerate(args), *sorted(kwargs.items())]
        if isinstance(v, torch.Tensor)
    )


def _separate_forward(original, state: _CallState, group, rank: int, *args, **kwargs):
    if not state.active:
        return original(*args, **kwargs)
    branch = state.calls % 2
    state.calls += 1
    key = _signature(args, kwargs)
    if branch == 0:  # conditional
        known = state.known.get(key)
        if rank == 0 or known is None:
            output = original(*args, **kwargs)
            tensor = _output_tensor(output)
            state.known[key] = (tuple(tensor.shape), tensor.dtype, output)
            state.cond = tensor
            state.cond_output = output if rank == 0 else None
            state.pending = tensor if rank == 1 else None
            return output
        shape, dtype, like = known
        state.pending = torch.empty(shape, dtype=dtype, device=_output_tensor(like).device)
        return _with_tensor(like, state.pending)
    # unconditional
    if rank == 1:
        output = original(*args, **kwargs)
        mine = _output_tensor(output)
    else:
        output, mine = state.cond_output, state.cond
    both = all_gather_uneven(mine.unsqueeze(0).contiguous(), [1, 1], 0, group)
    if rank == 1:
        state.pending.copy_(both[0])
        state.pending = None
        return output
    state.cond, state.cond_output = None, None
    return _with_tensor(output, both[1].clone())


_CALL_CLASSES: dict[type, type] = {}


def _wrapped_class(base: type) -> type:
    cls = _CALL_CLASSES.get(base)
    if cls is None:
        original_call = base.__call__

        @functools.wraps(original_call)
        def __call__(self, *args, **kwargs):
            runtime = self.__dict__.get(_STATE_ATTR)
            if runtime is None:
                return original_call(self, *args, **kwargs)
            return runtime.call(self, original_call, args, kwargs)

        cls = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                            "__qualname__": base.__qualname__})
        _CALL_CLASSES[base] = cls
    return cls


class _SeparateRuntime:
    def __init__(self, adapter: ModelAdapter, states: list[_CallState]) -> None:
        self.adapter = adapter
        self.states = states

    def call(self, pipe, original_call, args, kwargs):
        bound = inspect.signature(original_call).bind(pipe, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        scale = arguments.get(self.adapter.cfg.guidance_scale_argument)
        negatives = self.adapter.cfg.negative_arguments
        active = scale is not None and float(scale) > 1.0 and (
            not negatives or any(arguments.get(n) is not None for n in negatives))
        for state in self.states:
            state.active, state.calls, state.cond, state.pending = active, 0, None, None
            state.cond_output = None
        try:
            result = original_call(pipe, *args, **kwargs)
        finally:
            for state in self.states:
                state.active = False
        if any(state.calls % 2 for state in self.states):
            raise RuntimeError("cfg parallelism: the pipeline made a conditional call without "
                               "its unconditional one; the result is not valid")
        return result


def enable_cfg_parallel(pipe: Any, transformers: dict[str, nn.Module], adapter: ModelAdapter,
                        group, rank: int, size: int):
    """Split guidance branches over ``group``; returns the undo."""
    kind = check_cfg_parallel(adapter, pipe)
    undos = []
    if kind == "batched":
        for transformer in transformers.values():
            undos.append(_enable_batched(transformer, group, rank, size))
    else:
        states = []
        for transformer in transformers.values():
            state = _CallState()
            states.append(state)
            previous = transformer.__dict__.get("forward")
            transformer.forward = functools.partial(_separate_forward, transformer.forward, state,
                                                    group, rank)

            def restore(module=transformer, previous=previous):
                if previous is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = previous

            undos.append(restore)
        base = type(pipe)
        pipe.__dict__[_STATE_ATTR] = _SeparateRuntime(adapter, states)
        object.__setattr__(pipe, "__class__", _wrapped_class(base))

        def unwrap() -> None:
            object.__setattr__(pipe, "__class__", base)
            pipe.__dict__.pop(_STATE_ATTR, None)

        undos.append(unwrap)

    def undo() -> None:
        for fn in reversed(undos):
            fn()

    return undo


__all__ = ["check_cfg_parallel", "enable_cfg_parallel"]
