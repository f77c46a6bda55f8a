"""Halo exchange: a shard's boundary rows to and from its neighbours, into a pre-padded buffer.

A stride-1 convolution with kernel height ``k``, dilation ``d`` and top padding ``p`` reads, for
the rows a rank owns, ``lo = p`` rows above its shard and ``hi = d * (k - 1) - p`` rows below it.
Rank ``r`` therefore sends its first ``hi`` rows to rank ``r - 1`` and its last ``lo`` rows to
rank ``r + 1``, and receives the matching rows, in one ``batch_isend_irecv``. The fused kernels
of :mod:`omni_kernels.halo` pack the sent rows into persistent contiguous buffers and write the
convolution's whole input (received rows, shard, and zero or replicated rows at the image's
edges) into a persistent pre-padded buffer, so no ``torch.cat`` or ``F.pad`` copy is made.
"""

from __future__ import annotations

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


def exchange_halo(ctx: ShardContext, x: torch.Tensor, out: torch.Tensor, lo: int, hi: int,
                  edge_mode: int) -> torch.Tensor:
    """Fill ``out`` with ``x`` plus ``lo`` rows above and ``hi`` rows below from the neighbours.

    Args:
        ctx: the VAE group (rank ``r``'s neighbours are ``r - 1`` above and ``r + 1`` below).
        x: this rank's shard, ``[B, C, h, W]`` or ``[B, C, T, h, W]``; ``h >= max(lo, hi)``.
        out: ``x``'s shape with ``lo + h + hi`` rows, any strides (a view into a pre-padded
            buffer); written in full.
        lo, hi: halo rows above / below.
        edge_mode: what the first rank's top rows and the last rank's bottom rows hold:
            ``HALO_ZERO`` (zero padding) or ``HALO_REPLICATE``.

    Returns:
        ``out``.
    """
    rows = _as_rows(x)
    n, frames, h, w = rows.shape
    if h < max(lo, hi):
        raise ValueError(f"a shard of {h} rows cannot supply a halo of {max(lo, hi)} rows; use "
                         "fewer ranks or a larger latent")
    up, down = ctx.rank > 0, ctx.rank < ctx.world - 1
    send_up = ctx.buffer("send_up", (n, frames, hi if up else 0, w), rows)
    send_down = ctx.buffer("send_down", (n, frames, lo if down else 0, w), rows)
    recv_up = ctx.buffer("recv_up", (n, frames, lo if up else 0, w), rows)
    recv_down = ctx.buffer("recv_down", (n, frames, hi if down else 0, w), rows)
    ops = []
    if send_up.numel() or send_down.numel():
        halo_pack(rows, send_up, send_down, backend=ctx.halo_backend)
    for buf, peer, send in ((send_up, ctx.rank - 1, True), (recv_up, ctx.rank - 1, False),
                            (send_down, ctx.rank + 1, True), (recv_down, ctx.rank + 1, False)):
        if buf.numel():
            ops.append(dist.P2POp(dist.isend if send else dist.irecv, buf, ctx.peer(peer),
                                  group=ctx.group))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    halo_assemble(
        rows, recv_up, recv_down, _as_rows(out), lo_rows=lo, hi_rows=hi,
        lo_mode=HALO_RECV if up else edge_mode, hi_mode=HALO_RECV if down else edge_mode,
        backend=ctx.halo_backend,
    )
    return out
