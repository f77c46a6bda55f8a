"""``omni_sage_sm90``: omni's quantized attention with the Hopper CUDA kernel. **Lossy.**

The same math and quantization as ``omni_sage`` (:mod:`omni_kernels.attention.quantized`:
K smoothed by its mean, Q INT8 per token, K INT8 per 128-key block, V FP8 e4m3 per
channel, P in FP8 with two-level accumulation), with the attention itself in
``csrc/attention/sage_sm90.cu``: wgmma for both products, TMA loads, one producer and two
consumer warpgroups a 128-query tile. The quantization runs in Triton, faster than omni's CUDA
quantizer (``omni_kernels::sage_quantize_qkv``, which ``SageConfig(cuda_quantizer=True)``
selects). Either stores V^T's keys in the order that kernel's P fragments need
(``permute_v=True``).

Hopper only (compute capability 9.0; the kernel is sm_90a code), head_dim 128,
float16/bfloat16, CUDA tensors, omni's compiled extension. Both layouts, GQA,
``key_lengths`` and log-sum-exp; not causal, forward only. Called through the
``omni_kernels::sage_attention_fwd`` op with ``implementation="cuda_sm90"``, so ``torch.compile``
keeps it as one node.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from omni_kernels._triton import triton_unavailable_reason
from omni_kernels.attention.backends import omni_sage
from omni_kernels.attention.registry import register_backend


def _availability(device: torch.device | None) -> str | None:
    if device is None:
        if not torch.cuda.is_available():
            return "needs an NVIDIA Hopper GPU (CUDA); torch.cuda.is_available() is False"
        device = torch.device("cuda")
    if device.type != "cuda":
        return f"runs on CUDA devices only; got {device.type}"
    reason = triton_unavailable_reason(device)  # the quantizer is Triton
    if reason is not None:
        return reason
    module, reason = omni_sage.KERNEL_MODULE.load()
    if reason is not None:
        return reason
    return module.cuda_sm90_unsupported_reason(device, 128, torch.bfloat16)


# omni_sage's declaration (layouts, GQA, key lengths, LSE, lossy, not causal), narrowed to
# what the CUDA kernel takes.
SPEC = register_backend(
    dataclasses.replace(
        omni_sage.SPEC,
        name="omni_sage_sm90",
        run=functools.partial(omni_sage.run_backend, implementation="cuda_sm90"),
        description="omni's quantized attention: INT8 QK^T, FP8 PV (CUDA wgmma kernel, Hopper; lossy)",
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        head_dims=(128,),
        min_capability=(9, 0),
        availability=_availability,
    )
)
