"""Attention over sequence-sharded tokens: Ulysses inside, Ring outside (USP).

:class:`SequenceParallelAttention` takes the local ``[B, T + n_s, H, D]`` q/k/v of joint
attention (text ``T`` first or last, as the adapter's layout says; image shard ``n_s``). The
image part goes through a Ulysses all-to-all (:mod:`.ulysses`: the group's image tokens, this
rank's heads, uneven heads allowed); the text part is cut to this rank's heads locally. Then
Ring attention (:mod:`.ring`) over the ring ranks' image shards, with the text keys only in
the local step (every rank has them). The inverse all-to-all carries the text output of this
rank's heads to every Ulysses peer in the same message, so each rank ends with the full text
output the replicated text stream needs. Cross-attention (image queries, text keys) is left
alone. 1-rank groups skip their exchange, so at degree 1 the call is the plain attention call.

Text padding masks (``layout.text_mask``): the mask over the local text + image keys has its
image part all True; with Ulysses the keys become the text + the group's image tokens, and the
mask is rebuilt from its text part.

Routing: processors that call diffusers' ``dispatch_attention_fn`` get the ``"omni_sp"``
diffusers backend with the :class:`SequenceParallelAttention` as their ``_parallel_config``
(:func:`route_dispatcher_processor`); adapters with their own processors override
:meth:`~omni_diffusion.adapters.base.ModelAdapter.apply_parallel_attention`.
:class:`SequenceGroups` holds this rank's Ulysses and Ring groups and plans the image split.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from omni_diffusion.parallel.comm import all_gather_uneven
from omni_diffusion.parallel.config import offsets, split_sizes
from omni_diffusion.parallel.ring import ring_attention
from omni_diffusion.parallel.ulysses import head_slices, heads_to_sequence, sequence_to_heads
from omni_kernels.attention import attention
from omni_kernels.attention import normalize_key_padding_mask


SP_BACKEND_NAME = "omni_sp"


@dataclasses.dataclass(frozen=True)
class ImageSplit:
    """How ``total`` image tokens are split over the sequence ranks, seen from this rank.

    Planned once per image length (:meth:`SequenceGroups.split`), so no
    attention call or block re-plans it. ``sizes``: tokens per sequence rank
    (ring-major); this rank holds ``[start, start + mine)``;
    ``ulysses_sizes``: the shards of this rank's Ulysses group, in its rank
    order; ``ring_sizes``: each ring rank's Ulysses-group total.
    """

    total: int
    sizes: tuple[int, ...]
    start: int
    mine: int
    ulysses_sizes: tuple[int, ...]
    ring_sizes: tuple[int, ...]
    #: this rank's shard is the whole sequence (degree 1): nothing to cut locally
    #: (a field, not a property: every block wrapper reads it)
    whole: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "whole", self.mine == self.total)


@dataclasses.dataclass
class SequenceGroups:
    """The Ulysses and Ring process groups of this rank (either may have size 1)."""

    ulysses_group: Any
    ulysses_rank: int
    ulysses_size: int
    ring_group: Any
    ring_rank: int
    ring_size: int
    _splits: dict[int, ImageSplit] = dataclasses.field(default_factory=dict, repr=False,
                                                       compare=False)

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

    def split(self, total: int) -> ImageSplit:
        """The split of ``total`` image tokens (``torch.tensor_split``'s uneven cut), cached."""
        plan = self._splits.get(total)
        if plan is None:
            sizes = tuple(split_sizes(total, self.degree))
            u = self.ulysses_size
            first = self.ring_rank * u
            plan = self._splits[total] = ImageSplit(
                total=total, sizes=sizes, start=offsets(list(sizes))[self.rank],
                mine=sizes[self.rank], ulysses_sizes=sizes[first:first + u],
                ring_sizes=tuple(sum(sizes[r * u:(r + 1) * u]) for r in range(self.ring_size)))
        return plan

    def gather(self, x: torch.Tensor, split: ImageSplit, dim: int) -> torch.Tensor:
        """All sequence shards of ``x`` along ``dim``, in sequence-rank order (``x`` itself
        at degree 1). A 1-rank group is skipped here: its size is known, so no call asks
        the process group."""
        if self.ulysses_size > 1:
            x = all_gather_uneven(x, split.ulysses_sizes, dim, self.ulysses_group)
        if self.ring_size > 1:
            x = all_gather_uneven(x, split.ring_sizes, dim, self.ring_group)
        return x


@dataclasses.dataclass(slots=True)
class SequenceState:
    """What the current forward's blocks tell the attention: set by the block wrappers."""

    split: ImageSplit | None = None  # the image tokens' split over the sequence ranks
    text_len: int = 0


class SequenceParallelAttention:
    """Attention over sequence-sharded tokens (see the module docstring).

    Called as ``(query, key, value, attn_mask=None, scale=None)`` with
    ``[B, S_local, H, D]`` tensors (diffusers' layout); returns the same shape.
    ``joint``: the tokens are text + image (``text_first`` says the order);
    otherwise image only. ``text_mask``: a boolean key-padding mask over the
    local tokens whose image part is all True may come with joint q/k/v (its
    text part is applied; see the module docstring); otherwise a mask is
    refused. ``backend``: the omni attention backend (None: omni's per-call choice).

    A 1-rank Ulysses group leaves q/k/v as they come (no stack, no text/image
    split: every head and all of the group's tokens are here); a 1-rank ring
    attends once, with no LSE. So at degree 1 the call is the plain attention call.
    """

    def __init__(self, groups: SequenceGroups, state: SequenceState, *, joint: bool,
                 text_first: bool, backend: str | None, text_mask: bool = False) -> None:
        self.groups = groups
        self.state = state
        self.joint = joint
        self.text_first = text_first
        self.backend = backend
        self.text_mask = text_mask
        # read on every call: the group sizes are fixed
        self._exchange_heads = groups.ulysses_size > 1
        self._ring = groups.ring_size > 1

    def _attend(self, scale):
        def attend(q, k, v, mask):
            if q.shape[2] == 0:  # more Ulysses ranks than heads: this rank has none
                return q.clone(), q.new_zeros(q.shape[0], 0, q.shape[1], dtype=torch.float32)
            return attention(q, k, v, backend=self.backend, layout="bshd", scale=scale,
                             attn_mask=mask, return_lse=True)

        return attend

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        state = self.state
        split = state.split
        if split is None:
            raise RuntimeError("sequence-parallel attention ran outside the sharded blocks "
                               "(no image split is known)")
        groups = self.groups
        text = state.text_len if self.joint else 0
        mine = split.mine
        # whole shapes are compared (attention needs one head size for q, k and v anyway):
        # slices of them would be new torch.Size objects on every call
        shape = query.shape
        if shape[1] != text + mine or key.shape != shape or value.shape != shape:
            raise ValueError(
                f"sequence-parallel attention expects q/k/v of one shape, with {text} text + "
                f"{mine} image tokens; got q {tuple(shape)}, k {tuple(key.shape)}, "
                f"v {tuple(value.shape)}"
            )
        mask = None if attn_mask is None else self._key_mask(attn_mask, shape[0], text, split)
        if self._exchange_heads:
            q, k, v, ring_key, ring_value = self._heads_of_group(query, key, value, text, split)
        else:
            q, k, v = query, key, value
            if self._ring:
                image_start = text if self.text_first else 0
                ring_key, ring_value = key.narrow(1, image_start, mine), value.narrow(1, image_start, mine)
        if self._ring:
            out = ring_attention(q, k, v, mask, ring_key, ring_value, split.ring_sizes,
                                 groups.ring_rank, groups.ring_group, self._attend(scale))
        elif q.shape[2] == 0:
            out = q.clone()  # more Ulysses ranks than heads: this rank has none
        else:  # no partials to merge: no LSE needed
            out = attention(q, k, v, backend=self.backend, layout="bshd", scale=scale, attn_mask=mask)
        if not self._exchange_heads:
            return out
        return self._sequence_of_rank(out, text, split, shape[2])

    def _key_mask(self, attn_mask: torch.Tensor, batch: int, text: int, split: ImageSplit):
        """The key-padding mask for the keys this rank attends to in its local step.

        ``attn_mask``: bool, ``[B, T + mine]`` or ``[B, 1, 1, T + mine]`` over the local
        tokens in layout order, image part all True. With a 1-rank Ulysses group it is
        returned as it is (attention normalizes it); otherwise ``[B, T + n_group]``:
        its text part and the group's image keys, all attended.
        """
        if not (self.text_mask and text):
            what = "joint attention of a family whose layout declares a text padding mask" \
                if not self.text_mask else "joint attention over text tokens"
            raise ValueError(f"sequence-parallel attention got an attention mask of shape "
                             f"{tuple(attn_mask.shape)}; it takes one only in {what} "
                             "(SequenceLayout.text_mask)")
        if not self._exchange_heads:
            return attn_mask
        local = normalize_key_padding_mask(attn_mask, batch, text + split.mine)
        text_part = local.narrow(1, 0 if self.text_first else split.mine, text)
        image_part = text_part.new_ones(batch, sum(split.ulysses_sizes))
        return torch.cat([text_part, image_part] if self.text_first else [image_part, text_part], dim=1)

    def _heads_of_group(self, query, key, value, text: int, split: ImageSplit):
        """Ulysses forward exchange: ``[B, T + mine, H, D]`` q/k/v to ``[B, T + n_group,
        h_rank, D]`` (text for this rank's heads, the group's image tokens), and the
        image key/value part ``[B, n_group, h_rank, D]`` that Ring passes around."""
        groups = self.groups
        qkv = torch.stack([query, key, value])  # [3, B, S, H, D]: one all-to-all for the three
        image_start = text if self.text_first else 0
        txt = qkv.narrow(2, 0 if self.text_first else split.mine, text)
        img = qkv.narrow(2, image_start, split.mine)
        heads_here = head_slices(query.shape[2], groups.ulysses_size)[groups.ulysses_rank]
        img = sequence_to_heads(img, split.ulysses_sizes, groups.ulysses_rank, groups.ulysses_group,
                                seq_dim=2)
        txt = txt[:, :, :, heads_here]
        joint = torch.cat([txt, img] if self.text_first else [img, txt], dim=2)
        q, k, v = joint.unbind(0)
        return q, k, v, img[1], img[2]

    def _sequence_of_rank(self, out: torch.Tensor, text: int, split: ImageSplit, heads: int):
        """Ulysses inverse exchange: ``[B, T + n_group, h_rank, D]`` to ``[B, T + mine, H, D]``
        in the layout's text/image order."""
        groups = self.groups
        group_len = sum(split.ulysses_sizes)
        img_out = out.narrow(1, text if self.text_first else 0, group_len)
        txt_out = out.narrow(1, 0 if self.text_first else group_len, text)
        res = heads_to_sequence(img_out, split.ulysses_sizes, heads, groups.ulysses_rank,
                                groups.ulysses_group, seq_dim=1, prefix=txt_out if text else None)
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
    return _parallel_config(query, key, value, attn_mask, scale)


@functools.cache
def sp_backend_member():
    """Register ``"omni_sp"`` as a diffusers attention backend (once); its enum member.

    Goes through :func:`omni_diffusion.attention.diffusers_backend.register_diffusers_backend`
    (enum extension, checked there), with this module's function as the backend.
    """
    from omni_diffusion.attention.diffusers_backend import register_diffusers_backend

    return register_diffusers_backend(SP_BACKEND_NAME, _sp_diffusers_attention,
                                      supports_context_parallel=True)


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


__all__ = [
    "SP_BACKEND_NAME",
    "ImageSplit",
    "SequenceGroups",
    "SequenceParallelAttention",
    "SequenceState",
    "route_dispatcher_processor",
    "sp_backend_member",
]
