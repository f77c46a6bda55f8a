"""``torch.library`` registration of the quantized attention forward.

``torch.ops.omni_kernels.sage_attention_fwd(q, k, v, layout, scale, key_lengths,
implementation) -> (out, lse)`` wraps :func:`.attention_kernel.sage_attention_forward` (quantize
+ attend) as one opaque node for ``torch.compile``. The fake implementation
gives ``out`` with ``q``'s shape and dtype, contiguous in ``layout`` (as the real
one allocates it), and ``lse`` float32 ``[B, Hq, Sq]``. Functional, forward-only.

No ``from __future__ import annotations`` here: ``custom_op`` reads the schema
from the real annotations.
"""

from typing import Optional

import torch

from omni_kernels._extension import has_compiled_extension
from omni_kernels.attention.ops import output_shapes

OP_NAME = "omni_kernels::sage_attention_fwd"


@torch.library.custom_op(OP_NAME, mutates_args=(), device_types=None)
def sage_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: str,
    scale: float,
    key_lengths: Optional[torch.Tensor],
    implementation: str = "triton",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: out contiguous in ``layout``, lse float32 ``[B, Hq, Sq]``.

    ``implementation``: ``"triton"`` (the default config of the Triton kernel) or
    ``"cuda_sm90"`` (the Hopper wgmma kernel, :data:`~.attention_kernel.CUDA_SM90_CONFIG`).
    Not called ``kernel``: Inductor passes the op itself to its fallback as ``kernel=``, and an
    argument of that name breaks the lowering under ``torch.compile``."""
    out_shape, _ = output_shapes(q, layout)
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    return run_sage_attention(q, k, v, layout, scale, key_lengths, implementation, out=out)


def run_sage_attention(q, k, v, layout, scale, key_lengths, implementation="triton", *,
                       return_lse=True, out=None):
    """The op's body, for eager callers too (without the op's dispatch): ``(out, lse)``, or
    ``out`` alone when ``return_lse`` is false. ``implementation`` as for the op."""
    from omni_kernels.attention.quantized.attention_kernel import (
        CUDA_SM90_CONFIG,
        KERNELS,
        sage_attention_forward,
    )

    if implementation not in KERNELS:
        raise ValueError(f"implementation must be one of {KERNELS}; got {implementation!r}")
    return sage_attention_forward(
        q, k, v, layout=layout, scale=scale, key_lengths=key_lengths, return_lse=return_lse, out=out,
        config=CUDA_SM90_CONFIG if implementation == "cuda_sm90" else None,
    )


@sage_attention_fwd.register_fake
def _(q, k, v, layout, scale, key_lengths, implementation="triton"):
    out_shape, lse_shape = output_shapes(q, layout)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


def _fake_sage_attention_sm90(q_int8, q_scale, q_kmean, k_int8, k_scale, v_fp8, v_scale,
                              key_lengths, seq_kv, scale, out, lse, kv_splits=0,
                              programmatic_launch=False):
    return None  # writes out (and lse) in place


if has_compiled_extension() and hasattr(torch.ops.omni_kernels, "sage_attention_sm90"):
    torch.library.register_fake("omni_kernels::sage_attention_sm90")(_fake_sage_attention_sm90)


__all__ = ["OP_NAME", "run_sage_attention", "sage_attention_fwd"]
