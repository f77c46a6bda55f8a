"""The public entry points: :func:`attention`, :func:`select_backend`, :func:`run_backend`.

Each call is validated, its mask reduced (:mod:`.masks`), described as an
:class:`~omni_kernels.attention.spec.AttentionProblem`, and given a backend
(:mod:`.selection`). Masks other than key padding (per query, additive, per head) are not
accepted: call torch's SDPA. Any non-prefix key-padding mask runs only on backends that take
arbitrary masks (``sdpa_cudnn``, ``sdpa_efficient``, ``sdpa_math``); under ``torch.compile``
a mask is kept as a mask (its values are not read).
"""

from __future__ import annotations

import math

import torch

from omni_kernels.attention.masks import _mask_lengths, normalize_key_padding_mask
from omni_kernels.attention.registry import _REGISTRY, AUTO
from omni_kernels.attention.selection import _choose_auto, ineligible_reason, resolve_backend_request
from omni_kernels.attention.spec import LAYOUTS, AttentionProblem, BackendSpec, _arch_of


def _validate(q, k, v, layout, key_lengths):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor in layout {layout!r}; got {shape}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point; got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must share a device; got {q.device}, {k.device}, {v.device}")
    if layout == "bhsd":
        batch, hq, sq, d = q.shape
        bk, hkv, skv, dk = k.shape
        bv, hv, sv, dv = v.shape
    else:
        batch, sq, hq, d = q.shape
        bk, skv, hkv, dk = k.shape
        bv, sv, hv, dv = v.shape
    if not (batch == bk == bv):
        raise ValueError(f"q, k and v must share the batch size; got {batch}, {bk}, {bv}")
    if (hkv, skv) != (hv, sv):
        raise ValueError(f"k and v must have the same heads and length; got {tuple(k.shape)}, {tuple(v.shape)}")
    if not (d == dk == dv):
        raise ValueError(f"q, k and v must share head_dim; got {d}, {dk}, {dv}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if key_lengths is not None:
        if (
            not isinstance(key_lengths, torch.Tensor)
            or key_lengths.dtype.is_floating_point
            or key_lengths.dtype == torch.bool
            or tuple(key_lengths.shape) != (batch,)
        ):
            raise ValueError(f"key_lengths must be an integer tensor of shape [B] = [{batch}]")
    return batch, hq, hkv, sq, skv, d


def _swap(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _plan(q, k, v, backend, layout, causal, key_lengths, attn_mask, return_lse, allow_lossy):
    """``(spec, key_lengths, key_padding_mask)`` for a call, or ``ValueError``."""
    batch, hq, hkv, sq, skv, d = _validate(q, k, v, layout, key_lengths)
    name, lossy_ok, source = resolve_backend_request(backend, allow_lossy)

    mask = None
    if attn_mask is not None:
        if key_lengths is not None:
            raise ValueError("pass key_lengths or attn_mask, not both")
        mask = normalize_key_padding_mask(attn_mask, batch, skv)
        if mask.device != q.device:
            mask = mask.to(q.device)
        if not torch.compiler.is_compiling():
            lengths, full = _mask_lengths(mask)
            if full:  # nothing masked: drop the mask
                mask = None
            elif lengths is not None:
                key_lengths, mask = lengths, None
    if key_lengths is not None and (
        key_lengths.dtype != torch.int32 or key_lengths.device != q.device
    ):
        key_lengths = key_lengths.to(device=q.device, dtype=torch.int32)

    arch, capability = _arch_of(q.device)
    problem = AttentionProblem(
        device=q.device, arch=arch, capability=capability, dtype=q.dtype, layout=layout,
        batch=batch, heads_q=hq, heads_kv=hkv, seq_q=sq, seq_kv=skv, head_dim=d,
        causal=bool(causal), key_lengths=key_lengths is not None,
        key_padding_mask=mask is not None, return_lse=bool(return_lse),
        requires_grad=torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad),
    )
    if name == AUTO:
        spec = _choose_auto(problem, q, k, v, mask, lossy_ok)
    else:
        spec = _REGISTRY[name]
        reason = ineligible_reason(spec, problem, q, k, v, mask)
        if reason is not None:
            where = "" if source == "argument" else f" (from {source})"
            raise ValueError(f"backend={name!r}{where} {reason}")
    return spec, key_lengths, mask


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: str | None = None,
    layout: str = "bhsd",
    causal: bool = False,
    scale: float | None = None,
    key_lengths: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    return_lse: bool = False,
    allow_lossy: bool | None = None,
):
    """Scaled dot-product attention (forward) through the best or the named backend.

    Args:
        q, k, v: ``layout="bhsd"``: ``[B, Hq, Sq, D]`` and ``[B, Hkv, Skv, D]``;
            ``layout="bshd"`` (diffusers): ``[B, Sq, Hq, D]`` and ``[B, Skv, Hkv, D]``.
            Same dtype and device; ``Hq % Hkv == 0`` (GQA/MQA).
        backend: a registered name (:func:`list_backends`), ``"auto"``, or None:
            the :func:`attention_backend` context, else ``$OMNI_ATTENTION_BACKEND``,
            else ``"auto"``.
        causal: top-left aligned, as SDPA's ``is_causal``: query ``i`` sees keys ``j <= i``.
        scale: default ``1 / sqrt(D)``.
        key_lengths: integer ``[B]``; keys ``j >= key_lengths[b]`` are ignored.
            Rows with no key give 0 on omni_triton and NaN on the SDPA backends.
        attn_mask: bool key-padding mask ``[B, Skv]`` (or ``[B, 1, 1, Skv]``),
            True = attend; see the module docstring. Not with ``key_lengths``.
        return_lse: also return the natural-log log-sum-exp, float32 ``[B, Hq, Sq]``.
        allow_lossy: let ``"auto"`` pick a lossy (quantized) backend where the
            table ranks one; None: the context's or ``$OMNI_ATTENTION_ALLOW_LOSSY``.

    Returns:
        ``out`` in ``q``'s layout, shape and dtype (possibly a transposed view),
        or ``(out, lse)``.

    Raises:
        ValueError: bad arguments; an unknown backend name (the message lists
        them); a named backend that cannot take the call (the message names the
        constraint); no backend for ``"auto"``.
    """
    spec, key_lengths, mask = _plan(
        q, k, v, backend, layout, causal, key_lengths, attn_mask, return_lse, allow_lossy
    )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return run_backend(
        spec, q, k, v, layout=layout, causal=bool(causal), scale=float(scale),
        key_lengths=key_lengths, key_padding_mask=mask, return_lse=bool(return_lse),
    )


def run_backend(
    spec: BackendSpec, q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse
):
    """Run ``spec`` unchecked, converting layouts by transposed views."""
    native = layout if layout in spec.layouts else spec.layouts[0]
    if native != layout:
        q, k, v = _swap(q), _swap(k), _swap(v)
    result = spec.run(
        q, k, v, layout=native, causal=causal, scale=scale, key_lengths=key_lengths,
        key_padding_mask=key_padding_mask, return_lse=return_lse,
    )
    if return_lse:
        out, lse = result
    else:
        out, lse = result, None
    if native != layout:
        out = _swap(out)
    return (out, lse) if return_lse else out


def select_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: str | None = None,
    layout: str = "bhsd",
    causal: bool = False,
    key_lengths: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    return_lse: bool = False,
    allow_lossy: bool | None = None,
) -> tuple[str | None, str | None]:
    """Which backend :func:`attention` would run: ``(name, None)``, or ``(None, reason)``
    when it would raise. Nothing is computed (a mask may be inspected)."""
    try:
        spec, _, _ = _plan(
            q, k, v, backend, layout, causal, key_lengths, attn_mask, return_lse, allow_lossy
        )
    except ValueError as exc:
        return None, str(exc)
    return spec.name, None
