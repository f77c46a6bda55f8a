"""``xformers``: ``xformers.ops.memory_efficient_attention`` (package ``xformers``).

Takes ``bshd`` (xFormers' ``BMHK``). GQA goes through the 5-D ``BMGHK`` form
with the K/V heads broadcast (a stride-0 view, no copy); causal is
``LowerTriangularMask`` (top-left, as SDPA). No key lengths, no log-sum-exp.
xFormers wheels are built for one torch version; when its C++/CUDA extension
does not load against the running torch the backend reports that as unavailable.
"""

from __future__ import annotations

import torch

from omni_kernels.attention.backends._util import cuda_reason, last_dim_contiguous, lazy_import
from omni_kernels.attention.registry import register_backend
from omni_kernels.attention.spec import BackendSpec

_EXTENSION: dict[str, str | None] = {}


def _ops():
    return lazy_import("xformers.ops", "xformers", "pip install xformers (a wheel matching your torch)")


def _extension_reason() -> str | None:
    if "reason" not in _EXTENSION:
        reason = None
        try:
            import xformers

            if not getattr(xformers, "_has_cpp_library", True):
                built = ""
                try:
                    from xformers import _cpp_lib

                    meta = getattr(_cpp_lib, "_build_metadata", None)
                    if meta is not None:
                        built = f", built for torch {getattr(meta, 'torch_version', '?')}"
                except Exception:
                    pass
                reason = (
                    f"xformers {getattr(xformers, '__version__', '?')} C++/CUDA extension failed to "
                    f"load against torch {torch.__version__}{built}"
                )
        except Exception as exc:
            reason = f"xformers failed to import ({type(exc).__name__}: {exc})"
        _EXTENSION["reason"] = reason
    return _EXTENSION["reason"]


def _availability(device):
    reason = cuda_reason(device)
    if reason is not None:
        return reason
    _, reason = _ops()
    if reason is not None:
        return reason
    return _extension_reason()


def _run(q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse):
    ops, _ = _ops()
    bias = ops.LowerTriangularMask() if causal else None
    hq, hkv = q.shape[2], k.shape[2]
    if hq == hkv:
        return ops.memory_efficient_attention(q, k, v, attn_bias=bias, p=0.0, scale=scale)
    group = hq // hkv
    batch, sq, _, d = q.shape
    skv = k.shape[1]
    q5 = q.reshape(batch, sq, hkv, group, d)
    k5 = k[:, :, :, None, :].expand(batch, skv, hkv, group, d)
    v5 = v[:, :, :, None, :].expand(batch, skv, hkv, group, d)
    out = ops.memory_efficient_attention(q5, k5, v5, attn_bias=bias, p=0.0, scale=scale)
    return out.reshape(batch, sq, hq, d)


SPEC = register_backend(
    BackendSpec(
        name="xformers",
        run=_run,
        description="xFormers memory_efficient_attention",
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        head_dims=range(8, 257, 8),
        layouts=("bshd",),
        causal=True,
        causal_cross=True,
        gqa=True,
        key_lengths=False,
        key_padding_mask=False,
        lse=False,
        backward=True,
        min_capability=(7, 0),
        package="xformers",
        availability=_availability,
        input_check=lambda problem, q, k, v, mask: last_dim_contiguous(q, k, v),
    )
)
