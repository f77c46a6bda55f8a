"""``omni_sage_sm90``: omni's quantized attention with the Hopper CUDA kernel. **Lossy.**

The same math and quantization as ``omni_sage`` (:mod:`omni_kernels.attention.quantized`:
K smoothed by its mean, Q INT8 per token, K INT8 per 128-key block, V FP8 e4m3 per
channel, P in FP8 with two-level accumulation), with the attention itself in
``csrc/attention/sage_sm90.cu``: wgmma for both products, TMA loads, one producer and two
consumer warpgroups a 128-query tile. The quantization runs in Triton (on the H200 it is about
twice as fast as omni's CUDA quantizer, ``omni_kernels::sage_quantize_qkv``, which
``SageConfig(cuda_quantizer=True)`` selects); either stores V^T's keys in the order that
kernel's P fragments need (``permute_v=True``).

Hopper only (compute capability 9.0; the kernel is sm_90a code), head_dim 128,
float16/bfloat16, CUDA tensors, omni's compiled extension. Both layouts, GQA,
``key_lengths`` and log-sum-exp; not causal, forward only. Called through the
``omni_kernels::sage_attention_fwd`` op with ``implementation="cuda_sm90"``, so ``torch.compile``
keeps it as one node.
"""

from __future__ import annotations

import dataclasses

import torch

from omni_kernels._triton import eager_launch_allowed, triton_unavailable_reason
from omni_kernels.attention.backends import omni_sage
from omni_kernels.attention.backends._util import lazy_import
from omni_kernels.attention.registry import register_backend

_MODULE = "omni_kernels.attention.quantized.attention_kernel"


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
    module, reason = lazy_import(_MODULE, "omni", "reinstall omni")
    if reason is not None:
        return reason
    return module.cuda_sm90_unsupported_reason(device, 128, torch.bfloat16)


def _run(q, k, v, *, layout, causal, scale, key_lengths, key_padding_mask, return_lse):
    if eager_launch_allowed(q, k, v, key_lengths):
        # eager: the kernels straight away; the op is for torch.compile and fake tensors, and
        # its dispatch cost ~40 us a call on the H200's host (the call is ~0.45 ms at Flux)
        from omni_kernels.attention.quantized.attention_kernel import CUDA_SM90_CONFIG, sage_attention_forward

        return sage_attention_forward(q, k, v, layout=layout, scale=scale, key_lengths=key_lengths,
                                      return_lse=return_lse, config=CUDA_SM90_CONFIG)
    from omni_kernels.attention.quantized.ops import sage_attention_fwd

    out, lse = sage_attention_fwd(q, k, v, layout, scale, key_lengths, "cuda_sm90")
    return (out, lse) if return_lse else out


# omni_sage's declaration (layouts, GQA, key lengths, LSE, lossy, not causal), narrowed to
# what the CUDA kernel takes.
SPEC = register_backend(
    dataclasses.replace(
        omni_sage.SPEC,
        name="omni_sage_sm90",
        run=_run,
        description="omni's quantized attention: INT8 QK^T, FP8 PV (CUDA wgmma kernel, Hopper; lossy)",
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        head_dims=(128,),
        min_capability=(9, 0),
        availability=_availability,
    )
)
