"""``omni_triton``: omni's own Triton flash-attention forward.

The kernel is :func:`omni_kernels.attention.triton_flash.flash_attention_forward`,
called through the ``torch.library`` custom op ``omni_kernels::flash_attention_fwd``
(:mod:`omni_kernels.attention.ops`) so ``torch.compile`` treats it as one opaque
node. It reads both layouts through strides (no copy), does GQA, top-left causal
for any ``Sq``/``Skv``, per-sample ``key_lengths``, and returns the log-sum-exp.
Forward only. On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``),
where bfloat16 is broken, so CPU takes float16/float32; on CUDA float16/bfloat16.
"""

from __future__ import annotations

import functools
import importlib

import torch

from omni_kernels._triton import triton_unavailable_reason
from omni_kernels.attention.backends._util import triton_input_check
from omni_kernels.attention.registry import register_backend
from omni_kernels.attention.spec import BackendSpec

@functools.cache
def _import_error() -> str | None:
    try:
        importlib.import_module("omni_kernels.attention.triton_flash")
    except Exception as exc:  # ImportError, or triton failing to initialize
        return f"omni_kernels.attention.triton_flash failed to import ({type(exc).__name__}: {exc})"
    return None


def _availability(device: torch.device | None) -> str | None:
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    reason = triton_unavailable_reason(device)
    if reason is not None:
        return reason
    return _import_error()


def _run(q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse):
    from omni_kernels.attention.ops import flash_attention_fwd

    out, lse = flash_attention_fwd(q, k, v, layout, causal, scale, key_lengths)
    return (out, lse) if return_lse else out


SPEC = register_backend(
    BackendSpec(
        name="omni_triton",
        run=_run,
        description="omni's Triton flash-attention forward (omni_kernels.attention.triton_flash)",
        devices=("cuda", "cpu"),
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        head_dims=range(16, 257, 16),
        layouts=("bhsd", "bshd"),
        key_lengths=True,
        lse=True,
        min_capability=(8, 0),
        availability=_availability,
        input_check=triton_input_check,
    )
)
