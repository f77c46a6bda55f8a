"""``torch.library`` registration of the GEMM ops, so ``torch.compile`` traces them.

* ``omni_kernels::scaled_mm_triton``: the Triton GEMM (:mod:`.triton_gemm`), a custom op.
* ``omni_kernels::weight_only_gemv_triton``: the Triton GEMV (:mod:`.triton_gemv`), a
  ``triton_op`` Inductor launches itself (a plain custom op under the Triton interpreter).
* Fake implementations of the compiled ops ``omni_kernels::fp8_gemm_cublaslt`` and
  ``omni_kernels::quantized_linear_fp8`` (``csrc/``), when the extension has them.

Eager calls on plain tensors skip the op's dispatch and run the launcher
(:func:`omni_kernels._triton.eager_launch_allowed`).
"""

from __future__ import annotations

import torch

from omni_kernels._extension import has_compiled_extension
from omni_kernels._triton import eager_launch_allowed, triton_interpreter_enabled


# (An extension built before the op existed lacks it; the "cublaslt" backend then names why.)
_HAS_CUBLASLT_OP = has_compiled_extension() and hasattr(torch.ops.omni_kernels, "fp8_gemm_cublaslt")
if _HAS_CUBLASLT_OP:
    @torch.library.register_fake("omni_kernels::fp8_gemm_cublaslt")
    def _(a, a_scale, w, w_scale, bias, out_dtype, use_fast_accum, tune):
        return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


def fp8_gemm_plans() -> list[str]:
    """One line per cached plan of the ``"cublaslt"`` FP8 GEMM in this process: the problem
    (device, M, N, K, output dtype, bias, accumulation), cuBLASLt's algorithm (id, tile, stages,
    split-K, cluster) and how it was chosen (tuned: its rank among the timed candidates, its
    time and the heuristic's first choice's). Empty without the compiled op."""
    return list(torch.ops.omni_kernels.fp8_gemm_cublaslt_plans()) if _HAS_CUBLASLT_OP else []


@torch.library.custom_op("omni_kernels::scaled_mm_triton", mutates_args=(), device_types=None)
def _scaled_mm_triton_op(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor | None,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    from omni_kernels.quant.triton_gemm import launch_scaled_gemm_triton

    return launch_scaled_gemm_triton(a, b, a_scale, b_scale, bias, out_dtype, fast_accum)


@_scaled_mm_triton_op.register_fake
def _(a, b, a_scale, b_scale, bias, out_dtype, fast_accum=False):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _scaled_mm_triton(a, b, a_scale, b_scale, bias, out_dtype, fast_accum=False) -> torch.Tensor:
    """The op in traced code; in eager mode on plain tensors the launcher itself (the op would add
    only its dispatch: host time, which bounds eager INT8 layers)."""
    if eager_launch_allowed(a, b, a_scale, b_scale, bias):
        from omni_kernels.quant.triton_gemm import launch_scaled_gemm_triton

        return launch_scaled_gemm_triton(a, b, a_scale, b_scale, bias, out_dtype, fast_accum)
    return torch.ops.omni_kernels.scaled_mm_triton(a, b, a_scale, b_scale, bias, out_dtype, fast_accum)


# A triton_op lets Inductor launch the GEMV kernels itself; the Triton interpreter's kernels
# cannot be traced into (they read data pointers), so under it (CPU tests) the op is opaque.
_register_triton_op = torch.library.custom_op if triton_interpreter_enabled() else torch.library.triton_op


@_register_triton_op("omni_kernels::weight_only_gemv_triton", mutates_args=())
def _weight_only_gemv_triton_op(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    from omni_kernels.quant.triton_gemv import launch_weight_only_gemv

    return launch_weight_only_gemv(x, w_q, w_scale, bias)


@_weight_only_gemv_triton_op.register_fake
def _(x, w_q, w_scale, bias):
    # Explicit, so shape propagation never runs the launcher (fake tensors have no data).
    return x.new_empty((x.shape[0], w_q.shape[0]))



def _fake_quantized_linear_fp8(x, w_q, w_scale, bias, clamp, use_fast_accum, gemm):
    return x.new_empty((x.shape[0], w_q.shape[0]))


# (An extension built before the op existed, or before its `gemm` argument, serves no call: the
# two-call path then serves every call.)
_HAS_FUSED_FP8_OP = (
    has_compiled_extension() and hasattr(torch.ops.omni_kernels, "quantized_linear_fp8")
    and [a.name for a in torch.ops.omni_kernels.quantized_linear_fp8.default._schema.arguments][-1] == "gemm"
)
if _HAS_FUSED_FP8_OP:
    torch.library.register_fake("omni_kernels::quantized_linear_fp8")(_fake_quantized_linear_fp8)

