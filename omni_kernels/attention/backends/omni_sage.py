"""``omni_sage``: omni's quantized attention, INT8 ``Q K^T`` and FP8 ``P V``. **Lossy.**

The kernels are in :mod:`omni_kernels.attention.quantized` (SageAttention-2
style: K smoothed by the mean of a strided sample of its keys, Q INT8 per token,
K INT8 per key block, V FP8 e4m3 per key block, P in FP8 with two-level
accumulation). Called
through the ``torch.library`` op ``omni_kernels::sage_attention_fwd``
(:mod:`omni_kernels.attention.quantized.ops`), so ``torch.compile`` keeps it
as one node; in eager mode with plain tensors the kernels are launched directly
(the op's dispatch would add host time to every call). Quantization runs
inside every call (its cost is in the timing).

Takes both layouts through strides, GQA, ``key_lengths``, log-sum-exp; not
causal, no arbitrary masks, forward only. Head dims 64 and 128. Needs FP8
tensor cores: compute capability >= 8.9 (Ada, Hopper, Blackwell). On CPU it
runs under Triton's interpreter (``TRITON_INTERPRET=1``, float16/float32,
tests only). Being lossy, ``"auto"`` picks it only where the ranking table
lists it and the caller allows lossy backends; see
:mod:`omni_diffusion.attention_policy` for keeping chosen layers or denoising
steps in full precision.
"""

from __future__ import annotations

import torch

from omni_kernels._triton import eager_launch_allowed, triton_unavailable_reason
from omni_kernels._packages import OptionalPackage
from omni_kernels.attention.backends._util import triton_input_check
from omni_kernels.attention.registry import register_backend
from omni_kernels.attention.spec import BackendSpec

#: the quantized attention's kernel module (it imports triton)
KERNEL_MODULE = OptionalPackage("omni_kernels.attention.quantized.attention_kernel", "omni", "reinstall omni")


def _availability(device: torch.device | None) -> str | None:
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    reason = triton_unavailable_reason(device)
    if reason is not None:
        return reason
    _, reason = KERNEL_MODULE.load()
    return reason


def run_backend(q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse,
                implementation="triton"):
    """The registry's call, for omni_sage and (``implementation="cuda_sm90"``) omni_sage_sm90."""
    from omni_kernels.attention.quantized import ops

    if eager_launch_allowed(q, k, v, key_lengths):
        # eager: the kernels straight away; the op is for torch.compile and fake tensors (its
        # dispatch is host time on every call)
        return ops.run_sage_attention(q, k, v, layout, scale, key_lengths, implementation,
                                      return_lse=return_lse)
    out, lse = ops.sage_attention_fwd(q, k, v, layout, scale, key_lengths, implementation)
    return (out, lse) if return_lse else out


SPEC = register_backend(
    BackendSpec(
        name="omni_sage",
        run=run_backend,
        description="omni's quantized attention: INT8 QK^T, FP8 PV (Triton; lossy)",
        devices=("cuda", "cpu"),
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        head_dims=(64, 128),
        layouts=("bhsd", "bshd"),
        causal=False,
        causal_cross=False,
        key_lengths=True,
        lse=True,
        min_capability=(8, 9),
        lossy=True,
        availability=_availability,
        input_check=triton_input_check,
    )
)
