"""Unified sequence parallelism (USP): Ulysses inside, Ring outside, on a family's blocks.

Token placement
---------------
The ``ulysses * ring`` sequence ranks split the **image** (latent) tokens
along the sequence, from the first block's input to the last block's output
(a forward pre-hook on the first block narrows the hidden states, a hook on
the last block gathers them; the blocks between pass shards along). Sequence
rank ``s = ring_rank * ulysses + ulysses_rank`` holds tokens
``split_sizes(S, ulysses*ring)[s]`` (``torch.tensor_split``'s uneven split:
any length works, no padding). **Text tokens are replicated** on every rank:
they are short, and the text stream's per-token layers (norms, MLPs,
modulation) then run without communication. Rotary tables a block receives
for the whole sequence are cut to the local tokens per block (adapter's
:class:`~omni_diffusion.adapters.base.SequenceParallelPlan`).

Attention (:class:`SequenceParallelAttention`, per attention module)
--------------------------------------------------------------------
For joint attention the local ``q/k/v`` are ``[B, T + n_s, H, D]`` (text ``T``
first or last, as the adapter's layout says). The image part goes through a
Ulysses all-to-all (:mod:`.ulysses`: the Ulysses group's image tokens, this
rank's heads, uneven heads allowed); the text part is cut to this rank's heads
locally. Then Ring attention (:mod:`.ring`) over the ring ranks' image shards,
with the text keys only in the local step (they are on every rank already).
The output goes back by the inverse all-to-all, which carries the text output
of this rank's heads to every Ulysses peer in the same message, so each rank
ends with the full text output, as the replicated text stream needs.
Cross-attention modules (image queries, text keys: Wan's ``attn2``) are left
alone: their keys are replicated and their queries local.

Routing: processors that call diffusers' ``dispatch_attention_fn`` get omni's
``"omni_sp"`` diffusers backend, with the :class:`SequenceParallelAttention`
as their ``_parallel_config`` (the dispatcher passes it on as
``_parallel_config``); adapters with their own processors override
:meth:`~omni_diffusion.adapters.base.ModelAdapter.apply_parallel_attention`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Any

import torch
from torch import nn

from omni_diffusion.adapters.base import ModelAdapter, block_call
from omni_diffusion.parallel.comm import all_gather_uneven
from omni_diffusion.parallel.config import offsets, split_sizes
from omni_diffusion.parallel.ring import ring_attention
from omni_diffusion.parallel.ulysses import head_slices, heads_to_sequence, sequence_to_heads

SP_BACKEND_NAME = "omni_sp"


@dataclasses.dataclass
class SequenceGroups:
    """The Ulysses and Ring process groups of this rank (either may have size 1)."""

    ulysses_group: Any
    ulysses_rank: int
    ulysses_size: int
    ring_group: Any
    ring_rank: int
    ring_size: int

    @classmethod
    def from_mesh(cls, mesh) -> SequenceGroups:
        return cls(mesh.group("ulysses"), mesh.rank("ulysses"), mesh.size("ulysses"),
                   mesh.group("ring"), mesh.rank("ring"), mesh.size("ring"))

    @property
    def degree(self) -> int:
        return self.ulysses_size * self.ring_size

    @property
    def rank(self) -> int:
        return self.ring_rank * self.ulysses_size + self.ulysses_rank

    def ulysses_sizes(self, sizes: list[int]) -> list[int]:
        start = self.ring_rank * self.ulysses_size
        return sizes[start:start + self.ulysses_size]

    def ring_sizes(self, sizes: list[int]) -> list[int]:
        u = self.ulysses_size
        return [sum(sizes[r * u:(r + 1) * u]) for r in range(self.ring_size)]

    def gather(self, x: torch.Tensor, sizes: list[int], dim: int) -> torch.Tensor:
        """All sequence shards of ``x`` along ``dim``, in sequence-rank order."""
        x = all_gather_uneven(x, self.ulysses_sizes(sizes), dim, self.ulysses_group)
        return all_gather_uneven(x, self.ring_sizes(sizes), dim, self.ring_group)


@dataclasses.dataclass
class SequenceState:
    """What the current forward's blocks tell the attention: set by the block hooks."""

    image_sizes: list[int] | None = None  # image tokens per sequence rank
    text_len: int = 0


class SequenceParallelAttention:
    """Attention over sequence-sharded tokens (see the module docstring).

    Called as ``(query, key, value, attn_mask=None, scale=None)`` with
    ``[B, S_local, H, D]`` tensors (diffusers' layout); returns the same shape.
    ``joint``: the tokens are text + image (``text_first`` says the order);
    otherwise image only. ``backend``: the omni attention backend (None: omni's
    per-call choice).
    """

    def __init__(self, groups: SequenceGroups, state: SequenceState, *, joint: bool,
                 text_first: bool, backend: str | None) -> None:
        self.groups = groups
        self.state = state
        self.joint = joint
        self.text_first = text_first
        self.backend = backend

    def _attend(self, scale):
        from omni_kernels.attention import attention

        def attend(q, k, v, mask):
            if q.shape[2] == 0:  # more Ulysses ranks than heads: this rank has none
                return q.clone(), q.new_zeros(q.shape[0], 0, q.shape[1], dtype=torch.float32)
            return attention(q, k, v, backend=self.backend, layout="bshd", scale=scale,
                             attn_mask=mask, return_lse=True)

        return attend

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        sizes = self.state.image_sizes
        if sizes is None:
            raise RuntimeError("sequence-parallel attention ran outside the sharded blocks "
                               "(no image split is known)")
        if attn_mask is not None:
            raise ValueError("sequence-parallel attention takes no attention mask (the families "
                             "it supports pass none)")
        groups = self.groups
        text = self.state.text_len if self.joint else 0
        batch, seq, heads, _ = query.shape
        mine = sizes[groups.rank]
        if seq != text + mine or key.shape[:3] != query.shape[:3] or value.shape[:3] != query.shape[:3]:
            raise ValueError(
                f"sequence-parallel attention expects q/k/v of {text} text + {mine} image tokens "
                f"and equal heads; got q {tuple(query.shape)}, k {tuple(key.shape)}, "
                f"v {tuple(value.shape)}"
            )
        qkv = torch.stack([query, key, value])  # [3, B, S, H, D]
        image_start = text if self.text_first else 0
        txt = qkv.narrow(2, 0 if self.text_first else mine, text)
        img = qkv.narrow(2, image_start, mine)

        u_sizes = groups.ulysses_sizes(sizes)
        heads_here = head_slices(heads, groups.ulysses_size)[groups.ulysses_rank]
        img = sequence_to_heads(img, u_sizes, groups.ulysses_rank, groups.ulysses_group, seq_dim=2)
        txt = txt[:, :, :, heads_here]
        joint = torch.cat([txt, img] if self.text_first else [img, txt], dim=2)
        q, k, v = joint.unbind(0)
        if groups.ring_size == 1 and q.shape[2] == 0:
            out = q.clone()  # more Ulysses ranks than heads: this rank has none
        elif groups.ring_size == 1:  # no partials to merge: no LSE needed
            from omni_kernels.attention import attention

            out = attention(q, k, v, backend=self.backend, layout="bshd", scale=scale)
        else:
            out = ring_attention(q, k, v, None, img[1], img[2], groups.ring_sizes(sizes),
                                 groups.ring_rank, groups.ring_group, self._attend(scale))
        group_len = img.shape[2]
        img_out = out.narrow(1, text if self.text_first else 0, group_len)
        txt_out = out.narrow(1, 0 if self.text_first else group_len, text)
        res = heads_to_sequence(img_out, u_sizes, heads, groups.ulysses_rank, groups.ulysses_group,
                                seq_dim=1, prefix=txt_out if text else None)
        if text and not self.text_first:  # the all-to-all put the text in front
            res = torch.cat([res[:, text:], res[:, :text]], dim=1)
        return res


# --------------------------------------------------------------------------- diffusers routing


def _sp_diffusers_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                            scale=None, enable_gqa=False, return_lse=False, _parallel_config=None):
    if not isinstance(_parallel_config, SequenceParallelAttention):
        raise ValueError(f"the {SP_BACKEND_NAME!r} attention backend is set by omni's sequence "
                         "parallelism only (its processors carry the parallel state)")
    if dropout_p or is_causal or return_lse:
        raise ValueError(f"the {SP_BACKEND_NAME!r} attention backend takes no dropout, causal "
                         "mask or return_lse")
    return _parallel_config(query, key, value, attn_mask=attn_mask, scale=scale)


@functools.cache
def sp_backend_member():
    """Register ``"omni_sp"`` as a diffusers attention backend (once); its enum member.

    Uses the enum extension of :mod:`omni_diffusion.attention_backend` (checked
    there), with this module's function as the backend.
    """
    from omni_diffusion import attention_backend as ab

    ad = ab._dispatch_module()
    enum_cls = ad.AttentionBackendName
    member = enum_cls._value2member_map_.get(SP_BACKEND_NAME)
    if member is None:
        member_name = ab._member_name(SP_BACKEND_NAME)
        member = ab._add_enum_member(enum_cls, member_name, SP_BACKEND_NAME)
        problem = ab._verify_member(enum_cls, member, member_name, SP_BACKEND_NAME)
        if problem is not None:
            ab._remove_enum_member(enum_cls, member_name, SP_BACKEND_NAME)
            raise RuntimeError(f"could not add {SP_BACKEND_NAME!r} to diffusers' "
                               f"AttentionBackendName ({problem})")
    ad._AttentionBackendRegistry.register(member, constraints=[ab._check_inputs],
                                          supports_context_parallel=True)(_sp_diffusers_attention)
    return member


def route_dispatcher_processor(module: nn.Module, parallel: SequenceParallelAttention):
    """Point ``module``'s dispatcher-based processor at ``parallel``; returns the undo."""
    processor = getattr(module, "processor", None)
    if processor is None or not hasattr(processor, "_attention_backend"):
        raise ValueError(
            f"{type(module).__name__}'s processor {type(processor).__name__} does not go through "
            "diffusers' attention dispatcher; its adapter must route sequence-parallel attention"
        )
    if isinstance(getattr(processor, "_parallel_config", None), SequenceParallelAttention):
        raise ValueError(f"{type(module).__name__}: its processor is shared with another attention "
                         "module already made sequence-parallel")
    member = sp_backend_member()
    own = {name: processor.__dict__[name] for name in ("_attention_backend", "_parallel_config")
           if name in processor.__dict__}
    processor._attention_backend = member
    processor._parallel_config = parallel

    def undo() -> None:
        for name in ("_attention_backend", "_parallel_config"):
            if name in own:
                setattr(processor, name, own[name])
            else:
                processor.__dict__.pop(name, None)

    return undo


# --------------------------------------------------------------------------- block hooks


def _set_arg(block: nn.Module, args: tuple, kwargs: dict, name: str, value: Any) -> tuple[tuple, dict]:
    positions = block_call(block, args, kwargs)._positions
    if name not in kwargs and positions.get(name, len(args)) < len(args):
        args = list(args)
        args[positions[name]] = value
        return tuple(args), kwargs
    kwargs = dict(kwargs)
    kwargs[name] = value
    return args, kwargs


class _RotaryCutter:
    """Cuts the whole-sequence rotary tables to this rank's tokens, once per forward."""

    def __init__(self, plan, text_first: bool, groups: SequenceGroups, state: SequenceState) -> None:
        self.plan, self.text_first, self.groups, self.state = plan, text_first, groups, state
        self._key: tuple | None = None
        self._value: Any = None

    def _cut(self, table: torch.Tensor, text: int) -> torch.Tensor:
        dim = self.plan.rotary_seq_dim
        sizes = self.state.image_sizes
        full = sum(sizes)
        text = text if self.plan.rotary_covers_text else 0
        if table.shape[dim] != full + text:
            raise ValueError(f"rotary table of length {table.shape[dim]} along dim {dim}; expected "
                             f"{full} image + {text} text tokens")
        start = offsets(sizes)[self.groups.rank]
        mine = sizes[self.groups.rank]
        if not text:
            return table.narrow(dim, start, mine)
        if self.text_first:
            return torch.cat([table.narrow(dim, 0, text), table.narrow(dim, text + start, mine)], dim)
        return torch.cat([table.narrow(dim, start, mine), table.narrow(dim, full, text)], dim)

    def __call__(self, value: Any, text: int) -> Any:
        tensors = value if isinstance(value, (tuple, list)) else (value,)
        key = (tuple(tensors), text, tuple(self.state.image_sizes))
        if self._key is not None and len(self._key[0]) == len(key[0]) and all(
            a is b for a, b in zip(self._key[0], key[0])
        ) and self._key[1:] == key[1:]:
            return self._value
        cut = [self._cut(t, text) for t in tensors]
        result = type(value)(cut) if isinstance(value, (tuple, list)) else cut[0]
        self._key, self._value = key, result
        return result


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
    undos = []
    try:
        for module, joint in targets:
            sp = SequenceParallelAttention(groups, state, joint=joint, text_first=text_first,
                                           backend=backend)
            undos.append(adapter.apply_parallel_attention(module, sp))
        cutter = _RotaryCutter(plan, text_first, groups, state) if plan.rotary_arg else None
        first_block = lists[0][1][0]
        last_spec, last_list = lists[-1]
        for spec, module_list in lists:
            for block in module_list:
                hook = functools.partial(_before_block, spec=spec, first=block is first_block,
                                         groups=groups, state=state, cutter=cutter,
                                         rotary_arg=plan.rotary_arg,
                                         joint=adapter.layout.attention == "joint")
                undos.append(block.register_forward_pre_hook(hook, with_kwargs=True).remove)
        after = functools.partial(_after_last_block, spec=last_spec, groups=groups, state=state)
        undos.append(last_list[-1].register_forward_hook(after, with_kwargs=True).remove)
    except BaseException:
        for undo in reversed(undos):
            undo()
        raise

    def undo_all() -> None:
        for undo in reversed(undos):
            undo()

    return undo_all


def _before_block(block, args, kwargs, *, spec, first, groups, state, cutter, rotary_arg, joint):
    call = block_call(block, args, kwargs)
    if first:
        hidden = call.get(spec.hidden_arg)
        state.image_sizes = split_sizes(hidden.shape[1], groups.degree)
        start = offsets(state.image_sizes)[groups.rank]
        args, kwargs = _set_arg(block, args, kwargs, spec.hidden_arg,
                                hidden.narrow(1, start, state.image_sizes[groups.rank]))
    encoder = call.get(spec.encoder_arg) if joint else None
    state.text_len = 0 if encoder is None else encoder.shape[1]
    if cutter is not None:
        rotary = call.get(rotary_arg)
        if rotary is not None:
            args, kwargs = _set_arg(block, args, kwargs, rotary_arg, cutter(rotary, state.text_len))
    return args, kwargs


def _after_last_block(block, args, kwargs, output, *, spec, groups, state):
    hidden = groups.gather(spec.hidden_of(output), state.image_sizes, dim=1)
    return spec.pack(hidden, spec.encoder_of(output))


__all__ = [
    "SP_BACKEND_NAME",
    "SequenceGroups",
    "SequenceParallelAttention",
    "SequenceState",
    "enable_sequence_parallel",
    "route_dispatcher_processor",
]
