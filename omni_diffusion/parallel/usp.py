"""Unified sequence parallelism (USP) on a family's blocks: which rank holds which tokens.

The ``ulysses * ring`` sequence ranks split the **image** tokens from the first block's input
to the last block's output: a wrapper of the first block's forward narrows the hidden states,
one of the last block's gathers them. Sequence rank ``s = ring_rank * ulysses + ulysses_rank``
holds tokens ``split_sizes(S, ulysses*ring)[s]`` (``torch.tensor_split``'s uneven split, no
padding). **Text tokens are replicated**: they are short, and the text stream's per-token
layers then need no communication. Per-token block arguments (the adapter's
:class:`~omni_diffusion.adapters.base.SequenceParallelPlan`) follow the tokens: rotary tables
and key-padding masks over the whole sequence are cut to the local tokens, per-image-token
tensors are narrowed like the hidden states, counts of leading image tokens become this
shard's count. The attention over the shards: :mod:`.sequence_attention`.

At degree 1 (``force_sequence_parallel``) the path runs the ops of plain execution and no
more, and its Python stays short (eager runs can be bound by kernel launches): the per-block
bookkeeping is an instance ``forward`` wrapper (:class:`SequenceParallelForward`), not module
hooks, so ``nn.Module.__call__`` keeps its hook-free fast path.

Compilation: the wrappers' bookkeeping stays eager; regional compile compiles only the
wrapper's ``inner`` (:meth:`SequenceParallelForward.compile_inner`), so every block of a class
reuses one graph. Ulysses' all-to-alls are functional collectives traced into it; Ring's
point-to-point exchange is a graph break. The first block's shard is a contiguous copy, so it arrives with the strides
of the later blocks' inputs (a view would compile a second graph).
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Any

import torch
from torch import nn

from omni_diffusion.adapters.base import BlockCall, ModelAdapter, block_call
from omni_diffusion.parallel.sequence_attention import (
    ImageSplit,
    SequenceGroups,
    SequenceParallelAttention,
    SequenceState,
)


# --------------------------------------------------------------------------- block wrappers


def _set_arg(call: BlockCall, args: tuple, kwargs: dict, name: str, value: Any) -> tuple[tuple, dict]:
    position = call._positions.get(name, len(args))
    if name not in kwargs and position < len(args):
        args = list(args)
        args[position] = value
        return tuple(args), kwargs
    kwargs = dict(kwargs)
    kwargs[name] = value
    return args, kwargs


class _TokenTableCutter:
    """Cuts a table over the whole sequence (rotary tables, a key-padding mask) to this
    rank's tokens along ``dim``, once per forward (the blocks of one forward get the same
    table objects); a table this rank holds whole is passed on as it is.

    ``covers_text``: the table spans text and image tokens in the layout's order, else
    the image tokens alone. ``whole_entries``: positions, in a tuple of tables, of
    tables passed whole (tables over the replicated text alone).
    """

    def __init__(self, dim: int, covers_text: bool, whole_entries: tuple[int, ...], text_first: bool,
                 state: SequenceState, what: str) -> None:
        self.dim, self.covers_text, self.whole_entries = dim, covers_text, whole_entries
        self.text_first, self.state, self.what = text_first, state, what
        self._key: tuple = (None, None, None, None)  # (value, its tensors, text, split)
        self._value: Any = None

    def _cut(self, table: torch.Tensor, text: int, split: ImageSplit) -> torch.Tensor:
        dim = self.dim
        full = split.total
        text = text if self.covers_text else 0
        if table.shape[dim] != full + text:
            raise ValueError(f"{self.what} of length {table.shape[dim]} along dim {dim}; expected "
                             f"{full} image + {text} text tokens")
        start, mine = split.start, split.mine
        if not text:
            return table.narrow(dim, start, mine)
        if self.text_first:
            return torch.cat([table.narrow(dim, 0, text), table.narrow(dim, text + start, mine)], dim)
        return torch.cat([table.narrow(dim, start, mine), table.narrow(dim, full, text)], dim)

    def _cut_all(self, value: Any, tensors: tuple, text: int, split: ImageSplit) -> Any:
        cut = [t if i in self.whole_entries else self._cut(t, text, split)
               for i, t in enumerate(tensors)]
        return type(value)(cut) if isinstance(value, (tuple, list)) else cut[0]

    def __call__(self, value: Any, text: int) -> tuple[Any, bool]:
        """``(the tables for this rank's tokens, whether they differ from value)``."""
        split = self.state.split
        if split.whole or all(i in self.whole_entries for i in range(_entries(value))):
            return value, False
        tensors = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        if torch.compiler.is_compiling():  # no identity cache in a graph: the cut is traced ops
            return self._cut_all(value, tensors, text, split), True
        last, last_tensors, last_text, last_split = self._key
        # the same tables (by identity: a list may be refilled) for the same tokens
        if (value is last and last_text == text and last_split is split
                and len(tensors) == len(last_tensors)
                and all(a is b for a, b in zip(tensors, last_tensors))):
            return self._value, True
        result = self._cut_all(value, tensors, text, split)
        self._key, self._value = (value, tensors, text, split), result
        return result, True


def _entries(value: Any) -> int:
    return len(value) if isinstance(value, (tuple, list)) else 1


def enable_sequence_parallel(transformer: nn.Module, adapter: ModelAdapter, groups: SequenceGroups,
                             backend: str | None):
    """Shard ``transformer``'s image tokens over ``groups`` (see the module docstring).

    Returns the undo. Raises ``ValueError`` (before any change) when the
    adapter has no :class:`~omni_diffusion.adapters.base.SequenceParallelPlan`
    or the plan matches no attention module.
    """
    plan = adapter.sequence_parallel
    if plan is None:
        raise ValueError(f"sequence parallelism (ulysses/ring) is not available for the "
                         f"{adapter.name} family: its adapter declares no SequenceParallelPlan")
    lists = adapter.blocks(transformer)
    text_first = adapter.layout.text_position != "last"
    targets = []
    for name, module in transformer.named_modules():
        joint = any(fnmatch.fnmatchcase(name, p) for p in plan.joint_attention)
        image = any(fnmatch.fnmatchcase(name, p) for p in plan.image_attention)
        if joint or image:
            targets.append((module, joint))
    if not targets:
        raise ValueError(f"{type(transformer).__name__}: no attention module matches the "
                         f"{adapter.name} sequence-parallel plan {plan}")
    state = SequenceState()
    # (argument names, the first of which a block has; the cutter of their tables)
    cutters = []
    if plan.rotary_args:
        cutters.append((plan.rotary_args, _TokenTableCutter(
            plan.rotary_seq_dim, plan.rotary_covers_text, plan.rotary_text_entries, text_first,
            state, "rotary table")))
    if plan.mask_arg:
        cutters.append(((plan.mask_arg,), _TokenTableCutter(
            plan.mask_seq_dim, True, (), text_first, state, "attention mask")))
    undos = []
    try:
        for module, joint in targets:
            sp = SequenceParallelAttention(groups, state, joint=joint, text_first=text_first,
                                           backend=backend, text_mask=adapter.layout.text_mask)
            undos.append(adapter.apply_parallel_attention(module, sp))
        first_block = lists[0][1][0]
        last_spec, last_list = lists[-1]
        last_block = last_list[-1]
        for spec, module_list in lists:
            for block in module_list:
                before = _BeforeBlock(block, spec, first=block is first_block, groups=groups,
                                      state=state, plan=plan, cutters=cutters,
                                      joint=adapter.layout.attention == "joint")
                after = (functools.partial(_after_last_block, spec=last_spec, groups=groups,
                                           state=state) if block is last_block else None)
                undos.append(_wrap_forward(block, SequenceParallelForward(before, block.forward, after)))
    except BaseException:
        for undo in reversed(undos):
            undo()
        raise

    def undo_all() -> None:
        for undo in reversed(undos):
            undo()

    return undo_all


def _wrap_forward(block: nn.Module, wrapper: SequenceParallelForward):
    """Set ``wrapper`` as ``block``'s instance ``forward``; returns the undo, which puts back
    the instance ``forward`` there was (or none)."""
    had_forward = "forward" in block.__dict__
    previous = block.__dict__.get("forward")
    block.forward = wrapper

    def undo() -> None:
        if had_forward:
            block.forward = previous
        else:
            block.__dict__.pop("forward", None)

    return undo


class SequenceParallelForward:
    """A block's ``forward`` with the sequence-parallel bookkeeping around it.

    Installed as the block's instance attribute ``forward`` rather than as module hooks:
    ``nn.Module.__call__`` on a module without hooks takes its fast path and calls
    ``self.forward`` at once, where any hook sends every call of the block through the
    slow path (torch's hook dispatch: 3 more Python frames per call, several times this
    wrapper's cost), which shows at degree 1 in eager mode when the host's kernel launches
    bound the step.

    A call runs ``before(args, kwargs)`` (None, or the ``(args, kwargs)`` to call with:
    the per-token arguments cut to this rank's tokens), then ``inner``, the block's
    forward as it was, then ``after(output)`` on the last block (the gather of the image
    tokens; None elsewhere).

    Compile protocol: ``before``/``after`` are per-forward Python state (which block is
    first, the image split) and must stay out of compiled code, so a regional compile
    compiles only ``inner``, through :meth:`compile_inner`. ``accelerate()`` looks for
    that method on a block's instance ``forward``.
    """

    __slots__ = ("before", "inner", "after")

    def __init__(self, before, inner, after=None) -> None:
        self.before, self.inner, self.after = before, inner, after

    def __call__(self, *args, **kwargs):
        changed = self.before(args, kwargs)
        if changed is not None:
            args, kwargs = changed
        if self.after is None:
            return self.inner(*args, **kwargs)
        return self.after(self.inner(*args, **kwargs))

    def compile_inner(self, **compile_kwargs):
        """Replace ``inner`` by ``torch.compile(inner, **compile_kwargs)``; returns the undo
        (``inner`` as it was)."""
        previous = self.inner
        self.inner = torch.compile(previous, **compile_kwargs)

        def undo() -> None:
            self.inner = previous

        return undo


class _BeforeBlock:
    """What a block's :class:`SequenceParallelForward` runs before the block. The first
    block cuts the image tokens (planned once per length); every block records its text
    length and gets its per-token arguments for its tokens. Returns None (the arguments
    stand) when nothing had to change: a rank holding the whole sequence (degree 1)
    returns right after recording the text length, the one fact its attention needs.

    It runs once per block and forward, so what can be known beforehand is: the
    argument positions (read from the block's signature here, once) and which argument
    carries the text.
    """

    __slots__ = ("block_name", "spec", "first", "groups", "state", "plan", "cutters", "positions",
                 "hidden_position", "encoder_arg", "encoder_position")

    def __init__(self, block: nn.Module, spec, *, first: bool, groups: SequenceGroups,
                 state: SequenceState, plan, cutters: list, joint: bool) -> None:
        self.block_name = type(block).__name__
        self.spec, self.first, self.groups, self.state = spec, first, groups, state
        self.plan, self.cutters = plan, cutters
        self.positions = block_call(block, (), {})._positions
        self.hidden_position = self.positions.get(spec.hidden_arg)
        self.encoder_arg = spec.encoder_arg if joint else None
        self.encoder_position = self.positions.get(self.encoder_arg)

    def __call__(self, args: tuple, kwargs: dict):
        state = self.state
        if self.first:
            hidden = _passed(args, kwargs, self.spec.hidden_arg, self.hidden_position)
            split = state.split = self.groups.split(hidden.shape[1])
        else:
            split = state.split
            if split is None:
                raise RuntimeError(f"{self.block_name}: a sequence-parallel block ran before "
                                   "the first block planned the image split")
        encoder = _passed(args, kwargs, self.encoder_arg, self.encoder_position)
        state.text_len = 0 if encoder is None else encoder.shape[1]
        if split.whole:  # nothing to cut: every per-token argument is this rank's already
            return None
        return self._cut(BlockCall(self.positions, args, kwargs), split)

    def _cut(self, call: BlockCall, split: ImageSplit):
        """``(args, kwargs)`` with the per-token arguments cut to this rank's tokens."""
        spec, plan = self.spec, self.plan
        updates: dict[str, Any] = {}
        if self.first:
            hidden = call.get(spec.hidden_arg)
            # a copy with a whole tensor's strides, as the later blocks' inputs have:
            # a compiled block would otherwise recompile for the first block's view
            updates[spec.hidden_arg] = hidden.narrow(1, split.start, split.mine).clone(
                memory_format=torch.contiguous_format)
        for names, cutter in self.cutters:
            for name in names:
                value = call.get(name)
                if value is not None:
                    cut, changed = cutter(value, self.state.text_len)
                    if changed:
                        updates[name] = cut
                    break
        for name in plan.image_token_args:
            value = call.get(name)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != split.total:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{self.block_name} argument {name}: expected [B, {split.total}, "
                                 f"...] (one entry per image token), got {shape}")
            updates[name] = value.narrow(1, split.start, split.mine)
        for name in plan.leading_image_count_args:
            value = call.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{self.block_name} argument {name}: expected an int count of "
                                 f"leading image tokens, got {type(value).__name__}")
            updates[name] = min(max(value - split.start, 0), split.mine)
        args, kwargs = call.args, call.kwargs
        for name, value in updates.items():
            args, kwargs = _set_arg(call, args, kwargs, name, value)
        return (args, kwargs) if updates else None


def _passed(args: tuple, kwargs: dict, name: str | None, position: int | None) -> Any:
    """The value a call passed for parameter ``name`` (``position``: its index among the
    positional parameters, None if it has none), or None (also when ``name`` is None)."""
    if name is None:
        return None
    if name in kwargs:
        return kwargs[name]
    if position is not None and position < len(args):
        return args[position]
    return None


def _after_last_block(output, *, spec, groups, state):
    """The last block's ``output`` with this rank's image tokens gathered back to all of them."""
    hidden = spec.hidden_of(output)
    gathered = groups.gather(hidden, state.split, dim=1)
    if gathered is hidden:
        return output  # nothing was split: the block's output stands
    return spec.pack(gathered, spec.encoder_of(output))


__all__ = [
    "SequenceParallelForward",
    "enable_sequence_parallel",
]
