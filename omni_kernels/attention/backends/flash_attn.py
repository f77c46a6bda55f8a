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

import dataclasses
import inspect

import torch

from omni_kernels._packages import OptionalPackage
from omni_kernels.attention.backends._util import all_of, cuda_reason, has_symbols, last_dim_contiguous
from omni_kernels.attention.registry import register_backend
from omni_kernels.attention.spec import BackendSpec

_FA2 = OptionalPackage("flash_attn", "flash-attn", "pip install flash-attn --no-build-isolation")
_FA3 = OptionalPackage(
    "flash_attn_interface", "flash-attn-3",
    "build flash-attention's hopper/ directory: cd hopper && python setup.py install",
)


def _input_check(package: OptionalPackage):
    def check(problem, q, k, v, key_padding_mask):
        if problem.key_lengths:
            module, _ = package.load()
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


def _runner(package: OptionalPackage):
    def run(q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse):
        module, _ = package.load()
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
        run=_runner(_FA2),
        description="FlashAttention-2 (flash-attn package, flash_attn_func)",
        layouts=("bshd",),
        causal_cross=False,
        key_lengths=True,
        lse=True,
        backward=True,
        min_capability=(8, 0),
        package="flash-attn",
        availability=all_of(cuda_reason, has_symbols(_FA2, "flash_attn_func")),
        input_check=_input_check(_FA2),
    )
)

# FlashAttention-2's declaration, narrowed to what the Hopper build takes.
FLASH_ATTN3 = register_backend(
    dataclasses.replace(
        FLASH_ATTN,
        name="flash_attn3",
        run=_runner(_FA3),
        description="FlashAttention-3 for Hopper (flash_attn_interface.flash_attn_func)",
        head_dims=(64, 96, 128, 192, 256),
        min_capability=(9, 0),
        max_capability=(9, 0),
        package="flash-attn-3",
        availability=all_of(cuda_reason, has_symbols(_FA3, "flash_attn_func")),
        input_check=_input_check(_FA3),
    )
)
