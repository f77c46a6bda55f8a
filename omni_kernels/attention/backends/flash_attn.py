"""``flash_attn`` (FlashAttention-2, package ``flash-attn``) and ``flash_attn3``
(FlashAttention-3 for Hopper, module ``flash_attn_interface`` built from the
flash-attention repo's ``hopper/``).

Both take ``bshd`` natively (diffusers' layout: no copy). Their causal mask is
bottom-right aligned when ``Sq != Skv``, so causal is offered only for
``Sq == Skv`` (where both conventions agree). ``key_lengths`` go through
``flash_attn_with_kvcache(cache_seqlens=...)``, which reads the padded K/V in
place (no unpadding copy); that path is forward-only and not causal.
"""

from __future__ import annotations

import inspect

import torch

from omni_kernels.attention.backends._util import cuda_reason, last_dim_contiguous, lazy_import
from omni_kernels.attention.registry import register_backend
from omni_kernels.attention.spec import BackendSpec

_FA2_HINT = "pip install flash-attn --no-build-isolation"
_FA3_HINT = "build flash-attention's hopper/ directory: cd hopper && python setup.py install"


def _fa2():
    return lazy_import("flash_attn", "flash-attn", _FA2_HINT)


def _fa3():
    return lazy_import("flash_attn_interface", "flash-attn-3", _FA3_HINT)


def _availability(loader):
    def availability(device):
        reason = cuda_reason(device)
        if reason is not None:
            return reason
        module, reason = loader()
        if reason is not None:
            return reason
        if not hasattr(module, "flash_attn_func"):
            return f"{module.__name__} has no flash_attn_func (unsupported version)"
        return None

    return availability


def _input_check(loader):
    def check(problem, q, k, v, key_padding_mask):
        if problem.key_lengths:
            module, _ = loader()
            if not hasattr(module, "flash_attn_with_kvcache"):
                return "cannot take key_lengths: this version has no flash_attn_with_kvcache"
            if problem.causal:
                return "cannot take key_lengths with causal=True (kv-cache causal is bottom-right)"
            if problem.requires_grad:
                return "cannot take key_lengths with inputs that require grad (kv-cache path)"
        return last_dim_contiguous(q, k, v)

    return check


_ACCEPTS_RETURN_PROBS: dict[str, bool] = {}


def _accepts(fn, name: str) -> bool:
    key = f"{fn.__module__}.{fn.__qualname__}:{name}"
    if key not in _ACCEPTS_RETURN_PROBS:
        try:
            _ACCEPTS_RETURN_PROBS[key] = name in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            _ACCEPTS_RETURN_PROBS[key] = False
    return _ACCEPTS_RETURN_PROBS[key]


def _runner(loader):
    def run(q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse):
        module, _ = loader()
        if key_lengths is not None:
            result = module.flash_attn_with_kvcache(
                q, k, v, cache_seqlens=key_lengths, softmax_scale=scale, causal=False,
                return_softmax_lse=return_lse,
            )
        else:
            fn = module.flash_attn_func
            kwargs = {"softmax_scale": scale, "causal": causal}
            if return_lse and _accepts(fn, "return_attn_probs"):
                kwargs["return_attn_probs"] = True
            result = fn(q, k, v, **kwargs)
        if isinstance(result, (tuple, list)):
            out = result[0]
            lse = result[1] if len(result) > 1 else None
        else:
            out, lse = result, None
        if return_lse:
            if lse is None:
                raise RuntimeError(f"{module.__name__} returned no log-sum-exp")
            return out, lse.to(torch.float32)
        return out

    return run


FLASH_ATTN = register_backend(
    BackendSpec(
        name="flash_attn",
        run=_runner(_fa2),
        description="FlashAttention-2 (flash-attn package, flash_attn_func)",
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        head_dims=range(8, 257, 8),
        layouts=("bshd",),
        causal=True,
        causal_cross=False,
        gqa=True,
        key_lengths=True,
        key_padding_mask=False,
        lse=True,
        backward=True,
        min_capability=(8, 0),
        package="flash-attn",
        availability=_availability(_fa2),
        input_check=_input_check(_fa2),
    )
)

FLASH_ATTN3 = register_backend(
    BackendSpec(
        name="flash_attn3",
        run=_runner(_fa3),
        description="FlashAttention-3 for Hopper (flash_attn_interface.flash_attn_func)",
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        head_dims=(64, 96, 128, 192, 256),
        layouts=("bshd",),
        causal=True,
        causal_cross=False,
        gqa=True,
        key_lengths=True,
        key_padding_mask=False,
        lse=True,
        backward=True,
        min_capability=(9, 0),
        max_capability=(9, 0),
        package="flash-attn-3",
        availability=_availability(_fa3),
        input_check=_input_check(_fa3),
    )
)
