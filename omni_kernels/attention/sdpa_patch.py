"""Route ``torch.nn.functional.scaled_dot_product_attention`` through omni's backends.

For code that calls SDPA itself (non-diffusers projects, or diffusers' "native"
backend), :func:`patch_sdpa` swaps the module attribute
``torch.nn.functional.scaled_dot_product_attention`` for a wrapper while the
``with`` block runs::

    with omni_kernels.attention.patch_sdpa(backend="omni_triton"):
        model(x)

The wrapper sends a call to :func:`omni_kernels.attention.attention` (layout
``bhsd``) when omni can take it: 4-D ``[B, H, S, D]`` inputs, ``dropout_p == 0``
(SDPA applies dropout whenever ``dropout_p > 0``, training or not, so such calls
fall back), no mask or a boolean key-padding
mask broadcastable as ``[B, 1, 1, Skv]``, ``enable_gqa`` consistent with the head
counts, and a backend (``backend``, or the usual context / env / auto choice)
that accepts the dtype, head dim, device and features. Everything else goes to
the SDPA that was in place when the block was entered, unchanged; each distinct
fallback reason is logged once (``logging.INFO``) and counted in
:attr:`SdpaPatch.fallbacks`; routed calls are counted per backend in
:attr:`SdpaPatch.routed`.

Limits: code that bound the function earlier (``from torch.nn.functional import
scaled_dot_product_attention`` at import time) keeps the original; the patch is
process-wide (all threads) while active; nested patches restore in LIFO order
(each exit puts back what its entry found).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from omni_kernels.attention import api, registry

logger = logging.getLogger("omni_kernels.attention")

_LOCK = threading.Lock()


class SdpaPatch:
    """State of one :func:`patch_sdpa` block: counters and the wrapper itself."""

    def __init__(self, backend: str | None, allow_lossy: bool | None, original) -> None:
        self.backend = backend
        self.allow_lossy = allow_lossy
        self.original = original
        self.routed: collections.Counter[str] = collections.Counter()
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self._logged: set[str] = set()

    def _fallback(self, reason: str, args, kwargs):
        self.fallbacks[reason] += 1
        if reason not in self._logged and not torch.compiler.is_compiling():
            self._logged.add(reason)
            logger.info("patch_sdpa: falling back to torch SDPA: %s", reason)
        return self.original(*args, **kwargs)

    def __call__(
        self,
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        **extra,
    ):
        args = (query, key, value)
        kwargs = dict(
            attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra
        )
        if enable_gqa:
            kwargs["enable_gqa"] = enable_gqa
        if extra:
            return self._fallback(f"unsupported arguments {sorted(extra)}", args, kwargs)
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in args):
            return self._fallback("inputs are not 4-D [B, H, S, D]", args, kwargs)
        if dropout_p:
            return self._fallback("dropout_p > 0", args, kwargs)
        if query.shape[1] != key.shape[1] and not enable_gqa:
            return self._fallback("different head counts without enable_gqa", args, kwargs)
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool:
                return self._fallback("an additive (float) attn_mask", args, kwargs)
            shape = tuple(attn_mask.shape)
            if not (
                attn_mask.dim() == 4
                and shape[0] == query.shape[0]
                and shape[1] == 1
                and shape[2] == 1
                and shape[3] == key.shape[2]
            ):
                return self._fallback(
                    "attn_mask is not a key-padding mask [B, 1, 1, Skv]", args, kwargs
                )
            if is_causal:
                return self._fallback("attn_mask together with is_causal", args, kwargs)
        try:
            spec, key_lengths, mask = api._plan(
                query, key, value, self.backend, "bhsd", bool(is_causal), None, attn_mask,
                False, self.allow_lossy,
            )
        except ValueError as exc:
            return self._fallback(str(exc), args, kwargs)
        if scale is None:
            scale = query.shape[-1] ** -0.5
        self.routed[spec.name] += 1
        return api.run_backend(
            spec, query, key, value, layout="bhsd", causal=bool(is_causal), scale=float(scale),
            key_lengths=key_lengths, key_padding_mask=mask, return_lse=False,
        )


@contextlib.contextmanager
def patch_sdpa(
    backend: str | None = None, *, allow_lossy: bool | None = None
) -> Iterator[SdpaPatch]:
    """Replace ``torch.nn.functional.scaled_dot_product_attention`` inside the block.

    Args:
        backend: the omni backend for routed calls; None (default) resolves per
            call like :func:`omni_kernels.attention.attention` (context manager,
            ``$OMNI_ATTENTION_BACKEND``, then ``"auto"``). A backend that cannot
            take a call makes that call fall back to SDPA (no error).
        allow_lossy: passed to :func:`~omni_kernels.attention.attention`.

    Yields:
        the :class:`SdpaPatch` (``.routed``, ``.fallbacks`` counters).
    """
    if backend is not None:
        backend = registry._normalize_name(backend, "patch_sdpa()")
    with _LOCK:
        original = F.scaled_dot_product_attention
        patch = SdpaPatch(backend, allow_lossy, original)
        F.scaled_dot_product_attention = patch
    try:
        yield patch
    finally:
        with _LOCK:
            F.scaled_dot_product_attention = original


__all__ = ["SdpaPatch", "patch_sdpa"]
