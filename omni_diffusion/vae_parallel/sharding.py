"""How a feature map is split along its height across the ranks of a VAE group, and gathered back.

Rank ``r`` of ``N`` owns rows ``[offsets[r], offsets[r] + sizes[r])``; the first ``H % N`` ranks
hold one row more (uneven shards). The decoder's stride-1 "same" convolutions, local upsampling
and gathered attention keep every rank's share proportional, so after an upsampling by ``f`` rank
``r`` owns ``f * sizes[r]`` rows of the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# The sharded dimension: height, the second-to-last dimension of [B, C, H, W] and [B, C, T, H, W].
SHARD_DIM = -2


@dataclass(frozen=True)
class RowSplit:
    """Sizes and offsets of ``rows`` rows split over ``world`` ranks (larger shards first)."""

    rows: int
    world: int

    @property
    def sizes(self) -> tuple[int, ...]:
        base, extra = divmod(self.rows, self.world)
        return tuple(base + (r < extra) for r in range(self.world))

    @property
    def offsets(self) -> tuple[int, ...]:
        sizes = self.sizes
        return tuple(sum(sizes[:r]) for r in range(self.world))

    def scaled(self, factor: int) -> tuple[int, ...]:
        return tuple(s * factor for s in self.sizes)


@dataclass
class ShardContext:
    """The VAE group and the state every wrapped layer of one VAE shares.

    ``sharded`` is True only inside a spatially-sharded decode: outside it (encode, tiled or
    plain decode) every wrapper runs its layer unchanged. ``gathered`` is True while a
    global-context layer (attention) runs on the gathered feature map, where nested wrappers must
    also run unchanged. ``buffers`` holds the persistent halo exchange buffers (a few rows
    each), keyed by role, shape, dtype and device; convolution inputs come from
    :meth:`conv_input`.
    """

    group: dist.ProcessGroup
    rank: int
    world: int
    halo_backend: str = "auto"
    sharded: bool = False
    gathered: bool = False
    buffers: dict = field(default_factory=dict)

    @classmethod
    def for_group(cls, group: dist.ProcessGroup, halo_backend: str = "auto") -> ShardContext:
        return cls(group=group, rank=dist.get_rank(group), world=dist.get_world_size(group),
                   halo_backend=halo_backend)

    @property
    def active(self) -> bool:
        """Whether wrapped layers must treat their input as this rank's shard."""
        return self.sharded and not self.gathered

    def buffer(self, role: str, shape: tuple[int, ...], like: torch.Tensor,
               zero: bool = False) -> torch.Tensor:
        """A persistent buffer for ``role`` (allocated once per shape/dtype/device).

        ``zero=True`` zero-fills it at allocation only: callers rely on regions they never write
        (causal frames, global-edge rows) staying zero. Under autograd a fresh tensor is returned,
        because a buffer reused by the next layer would overwrite what backward needs.
        """
        if torch.is_grad_enabled() and like.requires_grad:
            return (torch.zeros if zero else torch.empty)(shape, dtype=like.dtype,
                                                          device=like.device)
        key = (role, tuple(shape), like.dtype, like.device)
        buf = self.buffers.get(key)
        if buf is None:
            buf = (torch.zeros if zero else torch.empty)(shape, dtype=like.dtype,
                                                         device=like.device)
            self.buffers[key] = buf
        return buf

    @staticmethod
    def conv_input(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A fresh contiguous ``shape`` buffer for a convolution's pre-padded input.

        Not persistent, by measurement: a buffer kept across layers adds its size to every
        other point of the decode (a persistent buffer per input shape held far more than
        diffusers' peak on a Wan decode; one shared buffer still added to the peak of the RMS
        norms' temporaries), whereas a buffer freed when its convolution returns costs one
        padded input at a time, less than diffusers' ``cat`` + ``F.pad``. The caching allocator
        hands the same block back every call, so no device allocation happens after the first
        frames.
        """
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def peer(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` (what point-to-point ops address)."""
        return dist.get_global_rank(self.group, group_rank)


def _padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` contiguous, zero-padded along :data:`SHARD_DIM` to ``rows`` (collectives need equal
    shapes on every rank)."""
    pad_rows = rows - x.shape[SHARD_DIM]
    if not pad_rows:
        return x.contiguous()
    shape = list(x.shape)
    shape[SHARD_DIM] = pad_rows
    return torch.cat([x, x.new_zeros(shape)], dim=SHARD_DIM)


def all_gather_rows(ctx: ShardContext, x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """Concatenate every rank's ``x`` along :data:`SHARD_DIM`; rank ``r`` holds ``sizes[r]`` rows.

    Uneven shards are padded to the largest for the collective and trimmed after. One rank:
    ``x`` itself (no copy).
    """
    if ctx.world == 1:
        return x
    send = _padded_rows(x, max(sizes))
    parts = [torch.empty_like(send) for _ in range(ctx.world)]
    dist.all_gather(parts, send, group=ctx.group)
    return torch.cat([p.narrow(SHARD_DIM, 0, s) for p, s in zip(parts, sizes)], dim=SHARD_DIM)


def gather_rows_to(ctx: ShardContext, x: torch.Tensor, sizes: tuple[int, ...],
                   dst: int) -> torch.Tensor:
    """Like :func:`all_gather_rows`, but only group rank ``dst`` gets the whole tensor.

    Other ranks get their own ``x`` back (they hold no copy of the full output).
    """
    if ctx.world == 1:
        return x
    send = _padded_rows(x, max(sizes))
    parts = [torch.empty_like(send) for _ in range(ctx.world)] if ctx.rank == dst else None
    dist.gather(send, parts, group=ctx.group, group_dst=dst)
    if ctx.rank != dst:
        return x
    return torch.cat([p.narrow(SHARD_DIM, 0, s) for p, s in zip(parts, sizes)], dim=SHARD_DIM)
