"""Ulysses sequence parallelism: all-to-all from sequence sharding to head sharding and back.

Before attention every rank of a Ulysses group holds all heads of its own
sequence shard; one all-to-all gives each rank all tokens of the group for its
share of the heads, attention runs locally, and a second all-to-all returns
the output to sequence sharding. Uneven cases are uneven splits, not padding:
rank ``j`` takes ``split_sizes(heads, U)[j]`` heads (so 24 heads over 5 ranks
works), and shards may hold different token counts. Every rank knows every
shard's size from the split plan, so nothing but the data is exchanged.

Tensors are in diffusers' ``[..., S, H, D]`` layout with the sequence at
``seq_dim`` and the heads right after it. With one rank both exchanges are the
identity and return their input (no copy).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from omni_diffusion.parallel.comm import all_to_all
from omni_diffusion.parallel.config import offsets, split_sizes


@functools.cache  # planned once per (heads, degree), not per attention call
def head_slices(heads: int, degree: int) -> tuple[slice, ...]:
    """The heads each of ``degree`` Ulysses ranks takes."""
    bounds = offsets(split_sizes(heads, degree))
    return tuple(slice(bounds[j], bounds[j + 1]) for j in range(degree))


def sequence_to_heads(x: torch.Tensor, seq_sizes: Sequence[int], rank: int, group,
                      seq_dim: int) -> torch.Tensor:
    """``x``: this rank's shard, ``[..., n_rank, H, D]`` (sequence at ``seq_dim``).

    Returns ``[..., sum(seq_sizes), h_rank, D]``: the group's shards in rank
    order, for this rank's heads. ``seq_sizes[j]`` is group rank ``j``'s shard length.
    """
    degree = len(seq_sizes)
    if degree == 1:
        return x
    heads = x.shape[seq_dim + 1]
    slices = head_slices(heads, degree)
    send = [x.narrow(seq_dim + 1, s.start, s.stop - s.start) for s in slices]
    mine = slices[rank].stop - slices[rank].start
    recv_shapes = []
    for size in seq_sizes:
        shape = list(x.shape)
        shape[seq_dim] = size
        shape[seq_dim + 1] = mine
        recv_shapes.append(shape)
    return torch.cat(all_to_all(send, recv_shapes, group), dim=seq_dim)


def heads_to_sequence(x: torch.Tensor, seq_sizes: Sequence[int], heads: int, rank: int, group,
                      seq_dim: int, prefix: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`sequence_to_heads`.

    ``x``: ``[..., sum(seq_sizes), h_rank, D]``; returns ``[..., n_rank, heads, D]``.
    ``prefix`` (``[..., T, h_rank, D]``, the output of tokens every rank holds,
    such as replicated text) travels in the same all-to-all to every rank and
    comes back in front: the result is then ``[..., T + n_rank, heads, D]``.
    """
    degree = len(seq_sizes)
    if degree == 1:
        return x if prefix is None else torch.cat([prefix, x], dim=seq_dim)
    slices = head_slices(heads, degree)
    bounds = offsets(list(seq_sizes))
    send = []
    for j in range(degree):
        part = x.narrow(seq_dim, bounds[j], seq_sizes[j])
        send.append(part if prefix is None else torch.cat([prefix, part], dim=seq_dim))
    extra = 0 if prefix is None else prefix.shape[seq_dim]
    recv_shapes = []
    for s in slices:
        shape = list(x.shape)
        shape[seq_dim] = extra + seq_sizes[rank]
        shape[seq_dim + 1] = s.stop - s.start
        recv_shapes.append(shape)
    return torch.cat(all_to_all(send, recv_shapes, group), dim=seq_dim + 1)


__all__ = ["head_slices", "heads_to_sequence", "sequence_to_heads"]
