"""Boolean key-padding masks to the forms backends take.

``key_lengths`` (integer ``[B]``: keys ``j >= key_lengths[b]`` are ignored) is the form
backends take natively. A boolean key-padding mask (``[B, Skv]`` or ``[B, 1, 1, Skv]``,
True = attend) is dropped when all True and turned into ``key_lengths`` when every row is a
prefix (``True...True False...False``); reading it costs one device-to-host sync.
"""

from __future__ import annotations

import torch


def normalize_key_padding_mask(attn_mask: torch.Tensor, batch: int, seq_kv: int) -> torch.Tensor:
    """``attn_mask`` as a bool ``[B, Skv]`` key-padding mask (True = attend), or ``ValueError``.

    Accepts ``[B, Skv]``, and the SDPA-broadcastable ``[B, 1, 1, Skv]`` / ``[B, 1, Skv]``.
    """
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool:
        kind = attn_mask.dtype if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
        raise ValueError(
            f"attn_mask must be a boolean key-padding mask [B, Skv] (True = attend); got {kind}. "
            "Additive or per-query masks are not supported here: use torch SDPA."
        )
    shape = tuple(attn_mask.shape)
    if len(shape) >= 2 and all(s == 1 for s in shape[1:-1]):
        mask = attn_mask.reshape(shape[0], shape[-1])
        if mask.shape[0] == batch and mask.shape[1] == seq_kv:
            return mask
    raise ValueError(
        f"attn_mask must be a boolean key-padding mask of shape [B, Skv] = [{batch}, {seq_kv}] "
        f"(or [B, 1, 1, Skv]); got {shape}. Per-query or per-head masks are not supported here: "
        "use torch SDPA."
    )


def key_padding_mask_to_lengths(mask: torch.Tensor) -> torch.Tensor | None:
    """int32 ``[B]`` key lengths when every row of the bool ``[B, Skv]`` mask is a prefix, else None.

    Syncs with the device once (the check reads the mask's values).
    """
    lengths, _ = _mask_lengths(mask)
    return lengths


def _mask_lengths(mask: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """``(lengths or None, all keys kept)`` for a bool ``[B, Skv]`` mask, in one host sync."""
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    prefix = torch.eq(mask, positions[None, :] < lengths[:, None]).all()
    full = mask.all()
    is_prefix, is_full = torch.stack([prefix, full]).tolist()
    return (lengths if is_prefix else None), bool(is_full)
