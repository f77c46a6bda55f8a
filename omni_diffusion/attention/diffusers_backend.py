"""omni's attention as a diffusers attention backend: ``transformer.set_attention_backend("omni")``.

diffusers (>= 0.35) routes the attention of its transformers through
``dispatch_attention_fn``, which looks backends up by an ``AttentionBackendName`` enum member
in ``_AttentionBackendRegistry``. :func:`register_diffusers_backend` adds a member to that enum
(as ``EnumType`` builds members, entered in its three lookup tables, as ``aenum.extend_enum``
does; checked to answer as a native member, undone with ``RuntimeError`` if not) and registers
the function; nothing of diffusers is patched or wrapped, so ``torch.compile(fullgraph=True)``
sees an ordinary member.

The ``"omni"`` backend runs :func:`omni_kernels.attention.attention` with ``backend`` unset
(the ``attention_backend()`` context, ``$OMNI_ATTENTION_BACKEND``, else ``"auto"``);
``set_attention_backend(model, "omni", omni_backend="omni_triton")`` pins one through a second
member ``"omni:omni_triton"``. q/k/v come as ``[B, S, H, D]`` and go on as ``layout="bshd"``.

Masks: none, or a boolean key-padding mask (``[B, Skv]`` / ``[B, 1, 1, Skv]``, Qwen-Image's)
go to omni. Additive or per-query masks and ``dropout_p > 0`` run torch SDPA as diffusers'
"native" backend does (logged once each, counted in :data:`FALLBACKS`). No context parallelism. ``DIFFUSERS_ATTN_BACKEND=omni`` cannot
work (diffusers reads it before omni registers): call :func:`set_attention_backend`.
"""

from __future__ import annotations

import collections
import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from omni_kernels.attention import attention as omni_attention
from omni_kernels.attention import get_backend

logger = logging.getLogger("omni_diffusion.attention_backend")

OMNI_BACKEND_NAME = "omni"

#: why calls went to torch SDPA instead of omni, and how often
FALLBACKS: collections.Counter[str] = collections.Counter()
_LOGGED_FALLBACKS: set[str] = set()

_SDPA = torch._C._nn.scaled_dot_product_attention


def _dispatch_module():
    try:
        return importlib.import_module("diffusers.models.attention_dispatch")
    except ImportError as exc:
        raise RuntimeError(
            "the omni diffusers attention backend needs diffusers >= 0.35 "
            f"(diffusers.models.attention_dispatch): {exc}"
        ) from exc


# --------------------------------------------------------------------------- the backend


def _fallback(reason: str, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """diffusers' "native" computation: SDPA on [B, H, S, D] permuted views."""
    FALLBACKS[reason] += 1
    if reason not in _LOGGED_FALLBACKS and not torch.compiler.is_compiling():
        _LOGGED_FALLBACKS.add(reason)
        logger.info("omni diffusers attention: falling back to torch SDPA: %s", reason)
    if (
        attn_mask is not None
        and attn_mask.ndim == 2
        and attn_mask.shape[0] == query.shape[0]
        and attn_mask.shape[1] == key.shape[1]
    ):
        attn_mask = attn_mask[:, None, None, :]
    q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    kwargs = {"enable_gqa": True} if (enable_gqa or q.shape[1] != k.shape[1]) else {}
    out = _SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=scale, **kwargs)
    return out.permute(0, 2, 1, 3)


def _unsupported_mask(query, key, attn_mask) -> str | None:
    if attn_mask is None:
        return None
    if attn_mask.dtype != torch.bool:
        return f"an additive attention mask ({attn_mask.dtype})"
    shape = tuple(attn_mask.shape)
    if len(shape) >= 2 and shape[0] == query.shape[0] and shape[-1] == key.shape[1] and all(
        s == 1 for s in shape[1:-1]
    ):
        return None
    return f"a boolean mask of shape {shape} that is not a key-padding mask [B, Skv]"


def _make_backend_fn(omni_backend: str | None):
    def omni_diffusers_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_lse: bool = False,
        _parallel_config: Any = None,
    ):
        if _parallel_config is not None:
            raise ValueError(
                "the 'omni' attention backend does not support diffusers context parallelism"
            )
        reason = "dropout_p > 0" if dropout_p else _unsupported_mask(query, key, attn_mask)
        if reason is not None:
            if return_lse:
                raise ValueError(f"the 'omni' attention backend cannot return lse with {reason}")
            return _fallback(reason, query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa)
        if attn_mask is not None and is_causal:
            raise ValueError("`is_causal` cannot be True when `attn_mask` is not None.")
        return omni_attention(
            query, key, value, backend=omni_backend, layout="bshd", causal=is_causal,
            scale=scale, attn_mask=attn_mask, return_lse=return_lse,
        )

    omni_diffusers_attention.__name__ = (
        "omni_diffusers_attention" if omni_backend is None else f"omni_diffusers_attention_{omni_backend}"
    )
    return omni_diffusers_attention


def _check_inputs(query, key, value, attn_mask=None, **kwargs) -> None:
    """Constraint diffusers runs when ``DIFFUSERS_ATTN_CHECKS`` is set."""
    if query.device != key.device or query.device != value.device:
        raise ValueError("Query, key, and value must be on the same device.")
    if query.dtype != key.dtype or query.dtype != value.dtype:
        raise ValueError("Query, key, and value must have the same dtype.")
    if query.shape[-1] != key.shape[-1] or key.shape[1] != value.shape[1]:
        raise ValueError("Query/key head dims or key/value lengths differ.")


# --------------------------------------------------------------------------- enum member


def _add_enum_member(enum_cls, member_name: str, value: str):
    """Add ``member_name = value`` to the str-valued ``enum_cls`` as EnumType would."""
    if member_name in enum_cls._member_map_ or value in enum_cls._value2member_map_:
        raise RuntimeError(f"{enum_cls.__name__} already has {member_name!r} or {value!r}")
    member = str.__new__(enum_cls, value)
    member._name_ = member_name
    member._value_ = value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_map_[member_name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(member_name)
    type.__setattr__(enum_cls, member_name, member)
    return member


def _remove_enum_member(enum_cls, member_name: str, value: str) -> None:
    enum_cls._member_map_.pop(member_name, None)
    enum_cls._value2member_map_.pop(value, None)
    if member_name in enum_cls._member_names_:
        enum_cls._member_names_.remove(member_name)
    if member_name in enum_cls.__dict__:
        type.__delattr__(enum_cls, member_name)


def _verify_member(enum_cls, member, member_name: str, value: str) -> str | None:
    checks = (
        ("lookup by value", lambda: enum_cls(value) is member),
        ("lookup by name", lambda: enum_cls[member_name] is member),
        ("isinstance", lambda: isinstance(member, enum_cls)),
        ("iteration", lambda: member in list(enum_cls)),
        ("__members__", lambda: value in {m.value for m in enum_cls.__members__.values()}),
        ("str equality and hash", lambda: member == value and hash(member) == hash(value)),
        ("attribute", lambda: getattr(enum_cls, member_name) is member),
    )
    for what, check in checks:
        try:
            ok = check()
        except Exception as exc:  # noqa: BLE001
            return f"{what} raised {type(exc).__name__}: {exc}"
        if not ok:
            return f"{what} failed"
    return None


def _member_name(value: str) -> str:
    return value.upper().replace(":", "_").replace("-", "_")


def register_diffusers_backend(
    name: str, fn: Callable[..., torch.Tensor], *, supports_context_parallel: bool
):
    """Register ``fn`` as diffusers attention backend ``name``; returns its ``AttentionBackendName`` member.

    Adds ``name`` to diffusers' ``AttentionBackendName`` when it is not a member
    yet (the enum extension described in this module's docstring, verified),
    then registers ``fn`` in diffusers' ``_AttentionBackendRegistry`` with this
    module's input check as its constraint (run when ``DIFFUSERS_ATTN_CHECKS``
    is set); a name already registered gets ``fn`` instead. ``fn`` takes
    diffusers' dispatch arguments: ``query``/``key``/``value`` ``[B, S, H, D]``,
    ``attn_mask``, ``dropout_p``, ``is_causal``, ``scale``, ``enable_gqa``, ...
    Used for omni's own backends and for sequence parallelism's ``"omni_sp"``
    (:mod:`omni_diffusion.parallel.sequence_attention`).

    Raises:
        RuntimeError: diffusers is missing or too old, or the enum could not
            be extended cleanly. When this or the registration raises, an enum
            member added by this call is removed again.
    """
    ad = _dispatch_module()
    enum_cls = ad.AttentionBackendName
    member_name = _member_name(name)
    member = enum_cls._value2member_map_.get(name)
    added = member is None
    if added:
        member = _add_enum_member(enum_cls, member_name, name)
        problem = _verify_member(enum_cls, member, member_name, name)
        if problem is not None:
            _remove_enum_member(enum_cls, member_name, name)
            raise RuntimeError(
                f"could not add {name!r} to diffusers' AttentionBackendName ({problem}); "
                "this Python/diffusers combination is not supported by the omni backend"
            )
    try:
        ad._AttentionBackendRegistry.register(
            member, constraints=[_check_inputs], supports_context_parallel=supports_context_parallel
        )(fn)
    except Exception:
        if added:
            _remove_enum_member(enum_cls, member_name, name)
        raise
    return member


def register_omni_attention_backend(
    name: str = OMNI_BACKEND_NAME, *, omni_backend: str | None = None
):
    """Register omni as diffusers attention backend ``name`` (idempotent); returns the enum member.

    Args:
        name: the diffusers backend name; ``"omni"`` by default.
        omni_backend: the omni backend this diffusers backend always runs
            (e.g. ``"omni_triton"``); None (default): chosen per call by
            ``omni_kernels.attention``'s context manager, ``$OMNI_ATTENTION_BACKEND``
            or ``"auto"``.

    Raises:
        RuntimeError: diffusers is missing or too old, or the enum could not
            be extended cleanly (nothing is left changed then).
        ValueError: ``name`` is already a different diffusers backend, or
            ``omni_backend`` is unknown.
    """
    ad = _dispatch_module()
    if omni_backend is not None:
        omni_backend = get_backend(omni_backend).name  # ValueError listing the names

    member = ad.AttentionBackendName._value2member_map_.get(name)
    existing = None if member is None else ad._AttentionBackendRegistry._backends.get(member)
    if existing is not None and getattr(existing, "_omni_backend", "missing") == omni_backend:
        return member
    if existing is not None and not hasattr(existing, "_omni_backend"):
        raise ValueError(f"diffusers backend {name!r} already exists and is not omni's")

    fn = _make_backend_fn(omni_backend)
    fn._omni_backend = omni_backend
    return register_diffusers_backend(name, fn, supports_context_parallel=False)


def set_attention_backend(model, backend: str = OMNI_BACKEND_NAME, *, omni_backend: str | None = None):
    """``model.set_attention_backend(...)`` with omni's backend registered first.

    ``backend="omni"`` (default) registers omni (:func:`register_omni_attention_backend`);
    with ``omni_backend`` the model is pinned to that omni backend through a
    second diffusers name ``"omni:<omni_backend>"``. Any other ``backend`` is a
    diffusers name and is passed through. Returns the diffusers name set.
    """
    if backend == OMNI_BACKEND_NAME:
        if omni_backend is not None:
            backend = f"{OMNI_BACKEND_NAME}:{get_backend(omni_backend).name}"
        register_omni_attention_backend(backend, omni_backend=omni_backend)
    elif omni_backend is not None:
        raise ValueError("omni_backend only applies to backend='omni'")
    model.set_attention_backend(backend)
    return backend


__all__ = [
    "FALLBACKS",
    "OMNI_BACKEND_NAME",
    "register_diffusers_backend",
    "register_omni_attention_backend",
    "set_attention_backend",
]
