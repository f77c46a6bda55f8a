"""Collectives on uneven shards, built on torch's functional collectives.

``torch.distributed._functional_collectives`` ops are traceable by
``torch.compile`` and run on NCCL and gloo alike; omni adds no transport.
Uneven shards are exchanged as one flat buffer with per-peer split sizes
(``all_to_all_single``), and gathered by padding to the largest shard.

On a 1-rank group every collective is a no-op that returns its input (no
copy, no call into the process group): a strategy at degree 1 then costs
nothing, while its code path stays the one that runs at degree > 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(tensor) if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


def group_size(group) -> int:
    return dist.get_world_size(group)


def all_to_all(send: Sequence[torch.Tensor], recv_shapes: Sequence[Sequence[int]], group) -> list[torch.Tensor]:
    """Send ``send[j]`` to group rank ``j``; return what each rank ``i`` sent here.

    ``recv_shapes[i]`` is the shape rank ``i`` sends (every rank knows the
    split plan, so nothing is exchanged to learn sizes). All tensors share a
    dtype and device; any shapes, empty ones included.
    """
    world = group_size(group)
    if len(send) != len(recv_shapes) or len(send) != world:
        raise ValueError(f"all_to_all: {len(send)} send tensors, {len(recv_shapes)} receive "
                         f"shapes, group of {world}")
    if world == 1:  # what this rank sends itself, as a view where its layout allows
        return [send[0].reshape(tuple(recv_shapes[0]))]
    flat = torch.cat([t.reshape(-1) for t in send])
    in_splits = [t.numel() for t in send]
    out_splits = [math_prod(shape) for shape in recv_shapes]
    out = _wait(funcol.all_to_all_single(flat, out_splits, in_splits, group))
    return [chunk.view(tuple(shape)) for chunk, shape in zip(out.split(out_splits), recv_shapes)]


def math_prod(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def all_gather_uneven(tensor: torch.Tensor, sizes: Sequence[int], dim: int, group) -> torch.Tensor:
    """Concatenate along ``dim`` the shards of the group's ranks, rank ``i`` holding
    ``sizes[i]`` entries along ``dim`` (``tensor`` is this rank's)."""
    world = group_size(group)
    if len(sizes) != world:
        raise ValueError(f"all_gather_uneven: {len(sizes)} sizes for a group of {world}")
    if world == 1:
        return tensor
    dim = dim % tensor.dim()
    biggest = max(sizes)
    if tensor.shape[dim] < biggest:
        pad_shape = list(tensor.shape)
        pad_shape[dim] = biggest - tensor.shape[dim]
        tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)
    moved = tensor.movedim(dim, 0).contiguous()
    # all_gather_tensor, not all_gather_single: the latter is missing from torch 2.11 and older
    gathered = _wait(funcol.all_gather_tensor(moved, 0, group))  # [world*biggest, ...]
    parts = [gathered[i * biggest: i * biggest + sizes[i]] for i in range(world)]
    return torch.cat(parts, dim=0).movedim(0, dim)


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """The elementwise sum over the group: a new tensor, or ``tensor`` itself on a 1-rank group."""
    if group_size(group) == 1:
        return tensor
    return _wait(funcol.all_reduce(tensor, "sum", group))


__all__ = ["all_gather_uneven", "all_reduce_sum", "all_to_all", "group_size"]
