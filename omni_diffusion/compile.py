"""Regional ``torch.compile`` of a transformer's repeated blocks, and its undo."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from omni_diffusion.adapters.base import ModelAdapter
    from omni_diffusion.config import AccelConfig


def mark_graph_steps(transformer: nn.Module) -> Callable[[], None]:
    """Begin a new CUDA-graph step at every transformer forward; returns the undo.

    The repeated blocks share one compiled graph, so each forward replays it once per
    block. Without a step boundary, CUDA-graph trees take the first block of the next
    forward for a replay that may overwrite static outputs still alive, and raise on
    access ("accessing tensor output of CUDAGraphs that has been overwritten"). The
    transformer's own output comes from eager code after the last block, so nothing a caller
    keeps lives in graph memory.
    """
    def begin_step(module: nn.Module, args: tuple) -> None:
        torch.compiler.cudagraph_mark_step_begin()

    return transformer.register_forward_pre_hook(begin_step).remove


def _inner_compiler(module: nn.Module) -> Callable[..., Callable[[], None]] | None:
    """The ``compile_inner`` method of ``module``'s instance ``forward`` (a wrapper that
    keeps its own Python outside compiled code and compiles the forward it wraps;
    returns the undo), or None when its forward is no such wrapper."""
    compile_inner = getattr(module.__dict__.get("forward"), "compile_inner", None)
    return compile_inner if callable(compile_inner) else None


def apply_compile(transformer: nn.Module, adapter: ModelAdapter, config: AccelConfig):
    names = adapter.repeated_block_classes(transformer)
    targets = [m for m in transformer.modules() if type(m).__name__ in names]
    if not targets:
        raise ValueError(
            f"compile: no module of {type(transformer).__name__} is one of the repeated block "
            f"classes {names}"
        )
    kwargs: dict[str, Any] = dict(
        backend=config.compile_backend,
        # ring attention's point-to-point exchange is a graph break
        fullgraph=(adapter.compile_fullgraph and (config.parallel is None or config.parallel.ring == 1))
        if config.compile_fullgraph is None else config.compile_fullgraph,
        dynamic=config.compile_dynamic,
    )
    if config.torch_compile_mode is not None:
        kwargs["mode"] = config.torch_compile_mode
    # Per-forward Python bookkeeping around a block stays out of the compiled
    # region: compiled whole (``block.compile()``), Dynamo would trace it as
    # frames of their own, guarded on per-block Python state (which block is
    # first, the block's class), and recompile them for every block until the
    # recompile limit. Two forms of it:
    # - a forward wrapper (sequence parallelism's SequenceParallelForward): the
    #   block's instance ``forward`` has a ``compile_inner(**kwargs)`` method that
    #   compiles the forward it wraps and returns the undo; only that is compiled;
    # - forward hooks: the block's forward is compiled instead of its whole call,
    #   so the hooks run eagerly around it.
    wrapped = [m for m in targets if _inner_compiler(m) is not None]
    wrapped_ids = {id(m) for m in wrapped}
    hooked = [m for m in targets
              if id(m) not in wrapped_ids and (m._forward_pre_hooks or m._forward_hooks)]
    hooked_ids = {id(m) for m in hooked}
    saved = [(m, m.__dict__.get("_compiled_call_impl")) for m in targets]
    saved_forwards = [(m, m.__dict__.get("forward")) for m in hooked]
    inner_undos: list[Callable[[], None]] = []
    declared = tuple(getattr(transformer, "_repeated_blocks", None) or ())
    if (not hooked and not wrapped and declared and declared == names
            and hasattr(transformer, "compile_repeated_blocks")):
        transformer.compile_repeated_blocks(**kwargs)
    else:
        for module in targets:
            if id(module) in wrapped_ids:
                inner_undos.append(_inner_compiler(module)(**kwargs))
            elif id(module) in hooked_ids:
                module.forward = torch.compile(module.forward, **kwargs)
            else:
                module.compile(**kwargs)

    def undo() -> None:
        for undo_inner in reversed(inner_undos):
            undo_inner()
        for module, previous in saved:
            module._compiled_call_impl = previous
        for module, previous_forward in saved_forwards:
            if previous_forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous_forward

    return undo
