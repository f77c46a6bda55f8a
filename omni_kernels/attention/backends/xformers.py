"""``xformers``: ``xformers.ops.memory_efficient_attention`` (package ``xformers``).

Takes ``bshd`` (xFormers' ``BMHK``). GQA goes through the 5-D ``BMGHK`` form
with the K/V heads broadcast (a stride-0 view, no copy); causal is
``LowerTriangularMask`` (top-left, as SDPA). No key lengths, no log-sum-exp.
xFormers wheels are built for one torch version; when its C++/CUDA extension
does not load against the running torch the backend reports that as unavailable.
"""

from __future__ import annotations

import functools

import torch

from omni_kernels._packages import OptionalPackage
from omni_kernels.attention.backends._util import all_of, cuda_reason, has_symbols, last_dim_contiguous
from omni_kernels.attention.registry import register_backend
from omni_kernels.attention.spec import BackendSpec

_XFORMERS_OPS = OptionalPackage("xformers.ops", "xformers", "pip install xformers (a wheel matching your torch)")


@functools.cache
def _extension_reason() -> str | None:
    """Why xFormers' C++/CUDA extension did not load against this torch, or None."""
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
            return (
                f"xformers {getattr(xformers, '__version__', '?')} C++/CUDA extension failed to "
                f"load against torch {torch.__version__}{built}"
            )
    except Exception as exc:
        return f"xformers failed to import ({type(exc).__name__}: {exc})"
    return None


def _run(q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse):
    ops, _ = _XFORMERS_OPS.load()
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
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        layouts=("bshd",),
        backward=True,
        min_capability=(7, 0),
        package="xformers",
        availability=all_of(cuda_reason, has_symbols(_XFORMERS_OPS), lambda device: _extension_reason()),
        input_check=lambda problem, q, k, v, mask: last_dim_contiguous(q, k, v),
    )
)
