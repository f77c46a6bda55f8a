"""Exact merge of partial attention results over disjoint key sets.

Ring attention (and any split-KV scheme) computes attention of the same
queries against separate chunks of keys, each giving ``(out_i, lse_i)`` where
``out_i`` is normalized over its own chunk and ``lse_i`` is the natural-log
log-sum-exp of that chunk's scaled scores. Attention over the union is

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

An empty partial (a chunk where the row had no valid key) has ``lse = -inf``
and weight 0, whatever its ``out`` holds (even NaN); when both are empty the
merged row is 0 with ``lse = -inf``, as the kernels define it.

``out_*`` are in ``layout`` (``"bhsd"``: ``[B, H, Sq, D]``; ``"bshd"``:
``[B, Sq, H, D]``); ``lse_*`` are ``[B, H, Sq]`` for either layout, as
:func:`~omni_kernels.attention.triton_flash.flash_attention_forward` returns it.
Math is float32 (float64 if an input is float64).
"""

from __future__ import annotations

import torch

from omni_kernels.attention.reference import ATTENTION_LAYOUTS


def _merge_math(out_a, lse_a, out_b, lse_b, layout):
    if layout not in ATTENTION_LAYOUTS:
        raise ValueError(f"layout must be one of {ATTENTION_LAYOUTS}, got {layout!r}")
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a {tuple(out_a.shape)} and out_b {tuple(out_b.shape)} differ in shape")
    if lse_a.shape != lse_b.shape:
        raise ValueError(f"lse_a {tuple(lse_a.shape)} and lse_b {tuple(lse_b.shape)} differ in shape")
    if out_a.dim() != 4 or lse_a.dim() != 3:
        raise ValueError("out must be 4-D and lse 3-D ([B, H, Sq])")
    batch, heads, seq = lse_a.shape
    expected = (batch, heads, seq) if layout == "bhsd" else (batch, seq, heads)
    if tuple(out_a.shape[:3]) != expected:
        raise ValueError(
            f"out shape {tuple(out_a.shape)} does not match lse shape {tuple(lse_a.shape)} "
            f"in layout {layout!r}"
        )
    wide = torch.float64 in (out_a.dtype, out_b.dtype, lse_a.dtype, lse_b.dtype)
    compute = torch.float64 if wide else torch.float32
    la = lse_a.to(compute)
    lb = lse_b.to(compute)
    top = torch.maximum(la, lb)
    # Both empty: top is -inf; shift by 0 instead so no (-inf) - (-inf) = NaN appears.
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    wa = torch.exp(la - top)
    wb = torch.exp(lb - top)
    total = wa + wb
    lse = top + torch.log(total)  # log(0) = -inf when both are empty
    inv = torch.where(total > 0, 1.0 / torch.where(total > 0, total, 1.0), 0.0)
    wa = wa * inv
    wb = wb * inv
    if layout == "bshd":
        wa = wa.transpose(1, 2)
        wb = wb.transpose(1, 2)
    wa = wa[..., None]
    wb = wb[..., None]
    # An empty partial contributes nothing, even if its out holds NaN/Inf.
    part_a = torch.where(wa > 0, wa * out_a.to(compute), 0.0)
    part_b = torch.where(wb > 0, wb * out_b.to(compute), 0.0)
    return part_a + part_b, lse


def merge_attention_partials(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    layout: str = "bhsd",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets.

    Returns ``(out, lse)``: ``out`` in ``out_a``'s dtype and layout (contiguous),
    ``lse`` ``[B, H, Sq]`` in ``lse_a``'s dtype (float32 normally).
    """
    out, lse = _merge_math(out_a, lse_a, out_b, lse_b, layout)
    return out.to(out_a.dtype), lse.to(lse_a.dtype)


def merge_attention_partials_(
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    layout: str = "bhsd",
) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`merge_attention_partials`: the result overwrites ``out_acc`` and ``lse_acc``.

    Returns ``(out_acc, lse_acc)``. Meant for ring attention's running
    accumulator: start from an empty partial (any ``out``, ``lse = -inf``) and
    merge each chunk in.
    """
    out, lse = _merge_math(out_acc, lse_acc, out_b, lse_b, layout)
    out_acc.copy_(out)
    lse_acc.copy_(lse)
    return out_acc, lse_acc
