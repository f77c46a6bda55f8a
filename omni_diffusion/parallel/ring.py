"""Ring sequence parallelism: key/value shards travel around the ring, partials merge by LSE.

Each of the ``R`` ranks keeps its queries and, in ``R`` steps, attends them to
every rank's key/value shard: at step ``s`` it holds the shard of ring rank
``(r - s) mod R``, which it received from its predecessor while step ``s-1``
computed (point-to-point ``batch_isend_irecv``, so transfer overlaps compute).
Each step's ``(out, lse)`` from :func:`omni_kernels.attention.attention`
(``return_lse=True``) is folded into a float32 accumulator with
:func:`omni_kernels.attention.merge.merge_attention_partials_`, which is exact:
the result equals attention over all keys at once up to rounding.

Shards may differ in length (every rank knows the lengths, so receive buffers
are sized without an exchange). Keys that only the local step should see
(replicated text tokens, which every rank holds) go in ``local_key``/
``local_value``; only the ring shard travels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from omni_kernels.attention.merge import merge_attention_partials_

#: ``attend(q, k, v, mask) -> (out [B, Sq, H, D], lse [B, H, Sq] float32)``
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"],
                    tuple[torch.Tensor, torch.Tensor]]


@torch.compiler.disable  # point-to-point ops are not traceable: a graph break here
def ring_attention(query: torch.Tensor, local_key: torch.Tensor, local_value: torch.Tensor,
                   local_mask: torch.Tensor | None, ring_key: torch.Tensor, ring_value: torch.Tensor,
                   ring_sizes: Sequence[int], rank: int, group, attend: AttendFn) -> torch.Tensor:
    """Attention of ``query`` over the local keys and every ring rank's shard.

    Args:
        query: ``[B, Sq, H, D]``.
        local_key, local_value: ``[B, Sk, H, D]``, this rank's keys for step 0
            (they include ``ring_key``'s tokens: the own shard is not sent to itself).
        local_mask: bool key-padding mask ``[B, Sk]`` (or ``[B, 1, 1, Sk]``) for
            step 0, or None; the ring shards carry no mask (their keys are all attended).
        ring_key, ring_value: ``[B, ring_sizes[rank], H, D]``, the shard passed around.
        ring_sizes: shard length of each ring rank.
        attend: runs one attention with LSE (see :data:`AttendFn`).

    Returns ``[B, Sq, H, D]`` in ``query``'s dtype.
    """
    degree = len(ring_sizes)
    if degree == 1:
        return attend(query, local_key, local_value, local_mask)[0]
    nxt = dist.get_global_rank(group, (rank + 1) % degree)
    prv = dist.get_global_rank(group, (rank - 1) % degree)

    def post(held: torch.Tensor, source: int):
        shape = list(held.shape)
        shape[2] = ring_sizes[source]
        incoming = held.new_empty(shape)
        requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, held, nxt, group=group),
            dist.P2POp(dist.irecv, incoming, prv, group=group),
        ])
        return incoming, requests

    held = torch.stack([ring_key, ring_value]).contiguous()  # [2, B, n, H, D]
    incoming, requests = post(held, (rank - 1) % degree)
    out, lse = attend(query, local_key, local_value, local_mask)  # overlaps the first transfer
    acc = out.to(torch.float32).contiguous()
    acc_lse = lse.to(torch.float32).contiguous()
    for step in range(1, degree):
        for request in requests:
            request.wait()
        held, source = incoming, (rank - step) % degree
        if step + 1 < degree:  # pass it on while attending to it
            incoming, requests = post(held, (rank - step - 1) % degree)
        if ring_sizes[source] == 0:
            continue  # an empty shard adds nothing
        part, part_lse = attend(query, held[0], held[1], None)
        merge_attention_partials_(acc, acc_lse, part, part_lse, layout="bshd")
    return acc.to(query.dtype)


__all__ = ["ring_attention"]
