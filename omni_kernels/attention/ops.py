"""``torch.library`` registration of omni's Triton attention forward.

``torch.ops.omni_kernels.flash_attention_fwd(q, k, v, layout, causal, scale,
key_lengths) -> (out, lse)`` wraps
:func:`omni_kernels.attention.triton_flash.flash_attention_forward`. Its fake
(meta) implementation gives ``out`` with ``q``'s shape and dtype, contiguous in
``layout`` (the real one allocates it the same way), and ``lse`` float32
``[B, Hq, Sq]`` contiguous, so ``torch.compile(fullgraph=True)`` traces a model
that calls :func:`omni_kernels.attention.attention` with ``backend="omni_triton"``
and keeps the kernel as one node. The op is functional (``mutates_args=()``)
and forward-only (no autograd formula is registered).

The namespace ``omni_kernels`` is shared with the C++ ``TORCH_LIBRARY`` of
``omni_kernels._C``; ``custom_op`` registers through a ``FRAGMENT``, so both coexist.

No ``from __future__ import annotations`` here: ``custom_op`` reads the schema
from the real annotations.
"""

from typing import Optional

import torch

OP_NAME = "omni_kernels::flash_attention_fwd"


def output_shapes(q: torch.Tensor, layout: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(out shape, lse shape)`` of an attention forward: ``q``'s shape, and ``(B, Hq, Sq)``.

    ``layout`` is ``"bhsd"`` or ``"bshd"`` (ValueError otherwise). Shared with the
    quantized op (:mod:`omni_kernels.attention.quantized.ops`).
    """
    if layout == "bhsd":
        batch, heads, seq = q.shape[0], q.shape[1], q.shape[2]
    elif layout == "bshd":
        batch, seq, heads = q.shape[0], q.shape[1], q.shape[2]
    else:
        raise ValueError(f"layout must be 'bhsd' or 'bshd'; got {layout!r}")
    return tuple(q.shape), (batch, heads, seq)


@torch.library.custom_op(OP_NAME, mutates_args=(), device_types=None)
def flash_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: str,
    causal: bool,
    scale: float,
    key_lengths: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: out contiguous in ``layout``, lse float32 ``[B, Hq, Sq]``."""
    from omni_kernels.attention.triton_flash import flash_attention_forward

    out_shape, lse_shape = output_shapes(q, layout)
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    out, lse = flash_attention_forward(
        q, k, v, layout=layout, causal=causal, scale=scale, key_lengths=key_lengths,
        return_lse=True, out=out,
    )
    if tuple(lse.shape) != lse_shape or lse.dtype != torch.float32 or not lse.is_contiguous():
        lse = lse.reshape(lse_shape).to(torch.float32).contiguous()
    return out, lse


@flash_attention_fwd.register_fake
def _(q, k, v, layout, causal, scale, key_lengths):
    out_shape, lse_shape = output_shapes(q, layout)
    out = q.new_empty(out_shape)
    lse = q.new_empty(lse_shape, dtype=torch.float32)
    return out, lse


__all__ = ["OP_NAME", "flash_attention_fwd", "output_shapes"]
