"""PyTorch reference for dense scaled-dot-product attention (forward).

This module *defines* the semantics that every omni attention kernel follows
(:func:`omni_kernels.attention.triton_flash.flash_attention_forward` first):

* ``layout="bhsd"``: ``q`` is ``[B, Hq, Sq, D]``, ``k``/``v`` are ``[B, Hkv, Skv, D]``;
  ``layout="bshd"``: ``q`` is ``[B, Sq, Hq, D]``, ``k``/``v`` are ``[B, Skv, Hkv, D]``.
  The output has ``q``'s layout and shape.
* Grouped-query / multi-query attention: ``Hq % Hkv == 0``; query head ``h``
  reads key/value head ``h // (Hq // Hkv)``.
* ``scale`` defaults to ``1 / sqrt(D)``; scores are ``scale * q . k``.
* ``causal=True`` is the convention of ``torch.nn.functional.scaled_dot_product_attention(
  is_causal=True)``: **top-left aligned**, query ``i`` attends keys ``j <= i``
  (also when ``Sq != Skv``).
* ``key_lengths`` (integer ``[B]``): keys ``j >= key_lengths[b]`` are masked out
  for every query of sample ``b`` (padded prompts). Values are clamped to
  ``[0, Skv]``.
* A query row with no valid key at all (``key_lengths[b] == 0``, or ``Skv == 0``)
  outputs **zeros**, and its log-sum-exp is **-inf**.
* ``lse`` (``return_lse=True``) is the natural-log log-sum-exp of the scaled,
  masked scores, shaped ``[B, Hq, Sq]`` for either layout.
"""

from __future__ import annotations

import math

import torch

ATTENTION_LAYOUTS = ("bhsd", "bshd")


def _check_layout(layout: str) -> None:
    if layout not in ATTENTION_LAYOUTS:
        raise ValueError(f"layout must be one of {ATTENTION_LAYOUTS}, got {layout!r}")


def to_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A ``[B, H, S, D]`` view of ``x`` given in ``layout`` (no copy)."""
    _check_layout(layout)
    return x if layout == "bhsd" else x.transpose(1, 2)


def from_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` (``[B, H, S, D]``) as a view in ``layout``."""
    _check_layout(layout)
    return x if layout == "bhsd" else x.transpose(1, 2)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "bhsd",
    causal: bool = False,
    scale: float | None = None,
    key_lengths: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Attention by explicit math: ``softmax(scale * q k^T + mask) v``.

    Computed in float64 when ``q`` is float64, else in float32 (inputs are
    upcast). Returns ``out`` in ``q``'s dtype and layout, or ``(out, lse)``
    where ``lse`` is ``[B, Hq, Sq]`` in the compute dtype (float32, or float64
    for float64 inputs). See the module docstring for the exact semantics.

    The score matrix is materialized one batch sample at a time
    (``Hq * Sq * Skv`` values), so this is for testing, not for speed.
    """
    _check_layout(layout)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k and v must be 4-D")
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qb = to_bhsd(q, layout).to(compute)
    kb = to_bhsd(k, layout).to(compute)
    vb = to_bhsd(v, layout).to(compute)
    batch, hq, sq, d = qb.shape
    hkv, skv = kb.shape[1], kb.shape[2]
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    group = hq // hkv
    if group > 1:
        kb = kb.repeat_interleave(group, dim=1)
        vb = vb.repeat_interleave(group, dim=1)

    device = qb.device
    rows = torch.arange(sq, device=device)[:, None]
    cols = torch.arange(skv, device=device)[None, :]
    lengths = None
    if key_lengths is not None:
        lengths = key_lengths.to(device=device, dtype=torch.int64).clamp(0, skv)

    out = torch.empty((batch, hq, sq, vb.shape[-1]), dtype=compute, device=device)
    lse = torch.empty((batch, hq, sq), dtype=compute, device=device)
    for b in range(batch):
        scores = torch.matmul(qb[b], kb[b].transpose(-1, -2)) * scale  # [Hq, Sq, Skv]
        valid = torch.ones((sq, skv), dtype=torch.bool, device=device)
        if causal:
            valid &= cols <= rows
        if lengths is not None:
            valid &= cols < lengths[b]
        scores = scores.masked_fill(~valid, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # -inf for rows with no valid key
        finite = torch.isfinite(row_lse)
        probs = torch.exp(scores - torch.where(finite, row_lse, 0.0)[..., None])
        probs = torch.where(finite[..., None], probs, 0.0)
        out[b] = torch.matmul(probs, vb[b])
        lse[b] = row_lse
    out = from_bhsd(out, layout).to(q.dtype)
    if return_lse:
        return out, lse
    return out
