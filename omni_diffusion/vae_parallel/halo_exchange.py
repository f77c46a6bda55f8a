"""Halo exchange: a shard's boundary rows to and from its neighbours, into a pre-padded buffer.

A stride-1 convolution with kernel height ``k``, dilation ``d`` and top padding ``p`` reads, for
the rows a rank owns, ``lo = p`` rows above its shard and ``hi = d * (k - 1) - p`` rows below it.
Rank ``r`` therefore sends its first ``hi`` rows to rank ``r - 1`` and its last ``lo`` rows to
rank ``r + 1``, and receives the matching rows, in one ``batch_isend_irecv``. The fused kernels
of :mod:`omni_kernels.halo` pack the sent rows into persistent contiguous buffers and write the
convolution's whole input (received rows, shard, and zero or replicated rows at the image's
edges) into the shared pre-padded buffer (:meth:`.ShardContext.conv_input`), so no
``torch.cat`` or ``F.pad`` copy is made. On one rank nothing is exchanged: the assemble alone
pads the input.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from omni_diffusion.vae_parallel.sharding import ShardContext
from omni_kernels.halo import HALO_RECV, halo_assemble, halo_pack


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` or ``[B, C, T, H, W]`` viewed as the kernels' ``[N, T, H, W]``."""
    if t.dim() == 4:
        return t
    if t.dim() == 5:
        return t.flatten(0, 1)
    raise ValueError(f"expected a 4-D or 5-D feature map; got shape {tuple(t.shape)}")


def _flat_views(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Contiguous views of ``flat``, back to back, one per shape."""
    views, offset = [], 0
    for shape in shapes:
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        views.append(flat[offset:offset + numel].view(shape))
        offset += numel
    return views


def exchange_halo(ctx: ShardContext, parts: Sequence[tuple[torch.Tensor, torch.Tensor]], lo: int,
                  hi: int, edge_mode: int) -> None:
    """Fill each ``out`` with its ``x`` plus ``lo`` rows above and ``hi`` below from the neighbours.

    Args:
        ctx: the VAE group (rank ``r``'s neighbours are ``r - 1`` above and ``r + 1`` below).
        parts: ``(x, out)`` pairs exchanged together (one ``batch_isend_irecv`` for all): ``x``
            is a shard ``[B, C, h, W]`` or ``[B, C, T, h, W]`` (the same ``B, C, h, W`` in every
            pair, frames may differ: a causal conv's cached frames and its input), ``h >=
            max(lo, hi)``; ``out`` has ``x``'s shape with ``lo + h + hi`` rows, any strides (a
            view into the pre-padded buffer), and is written in full.
        lo, hi: halo rows above / below.
        edge_mode: what the first rank's top rows and the last rank's bottom rows hold:
            ``HALO_ZERO`` (zero padding) or ``HALO_REPLICATE``.
    """
    rows = [(_as_rows(x), _as_rows(out)) for x, out in parts]
    h = rows[0][0].shape[2]
    if h < max(lo, hi):
        raise ValueError(f"a shard of {h} rows cannot supply a halo of {max(lo, hi)} rows; use "
                         "fewer ranks or a larger latent")
    up, down = ctx.rank > 0, ctx.rank < ctx.world - 1
    recv_ups: list = [None] * len(rows)
    recv_downs: list = [None] * len(rows)
    if up or down:  # one rank exchanges nothing
        like = rows[0][0]
        slabs = [(x.shape[0], x.shape[1]) for x, _ in rows]
        w = like.shape[3]

        def buffers(role: str, count: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
            # One flat buffer per direction (one message for every part), a view per part.
            shapes = [(n, t, count, w) for n, t in slabs]
            flat = ctx.buffer(role, (sum(n * t * count * w for n, t in slabs),), like)
            return flat, _flat_views(flat, shapes)

        send_up, send_ups = buffers("send_up", hi if up else 0)
        send_down, send_downs = buffers("send_down", lo if down else 0)
        recv_up, recv_ups = buffers("recv_up", lo if up else 0)
        recv_down, recv_downs = buffers("recv_down", hi if down else 0)
        for (x, _), part_up, part_down in zip(rows, send_ups, send_downs):
            halo_pack(x, part_up, part_down, backend=ctx.halo_backend)
        ops = [dist.P2POp(op, flat, ctx.peer(peer), group=ctx.group)
               for flat, peer, op in ((send_up, ctx.rank - 1, dist.isend),
                                      (recv_up, ctx.rank - 1, dist.irecv),
                                      (send_down, ctx.rank + 1, dist.isend),
                                      (recv_down, ctx.rank + 1, dist.irecv))
               if flat.numel()]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for (x, out), recv_up, recv_down in zip(rows, recv_ups, recv_downs):
        halo_assemble(
            x, recv_up, recv_down, out, lo_rows=lo, hi_rows=hi,
            lo_mode=HALO_RECV if up else edge_mode, hi_mode=HALO_RECV if down else edge_mode,
            backend=ctx.halo_backend,
        )
