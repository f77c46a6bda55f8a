"""FP8/INT8 quantization for DiT linear layers.

* :func:`quantize_per_token`: per-token (per-row) dynamic activation
  quantization to FP8 e4m3 or INT8, optionally fused with the RMSNorm or
  LayerNorm and the adaLN modulation before a linear layer. Backends
  ``"cuda"`` (``csrc/quant/``), ``"triton"`` (:mod:`.triton_kernel`),
  ``"torch"`` (:mod:`.reference`).
* :func:`quantize_activated_per_token`: the same quantization of a GELU's output,
  the GELU applied in the quantization pass (Triton, :mod:`.activated_triton_kernel`);
  with ``prefix=``, of ``cat(prefix, GELU(x))`` without writing the ``cat``.
* :func:`quantize_weight`: per-output-channel weight quantization (once, at load time).
* :func:`scaled_mm` (W8A8) and :func:`weight_only_mm` (:mod:`.gemm`): the GEMMs, backends
  ``"aten"`` (``torch._scaled_mm`` / ``torch._int_mm`` / ``F.linear``),
  ``"cublaslt"`` (FP8 W8A8: omni's cuBLASLt op, one cached and tuned plan per problem;
  :func:`fp8_gemm_plans` lists them), ``"triton"`` (:mod:`.triton_gemm`, dequantization fused in the epilogue),
  ``"torch"`` (float32 reference); weight-only also ``"triton_gemv"``
  (:mod:`.triton_gemv`, for ``M <= 16`` rows: :data:`WEIGHT_ONLY_BACKENDS`).
* :class:`QuantizedLinear` (:mod:`.linear`): the ``nn.Linear`` replacement built on them
  (:meth:`QuantizedLinear.forward_concat`: the layer on ``cat(head, tail)``); its
  ``activation_backend="auto"`` quantizes with the kernels in eager mode and with
  plain torch ops under ``torch.compile`` (:func:`resolve_activation_backend`).
"""

from omni_kernels.quant.activated import ACTIVATED_QUANTIZE_BACKENDS, quantize_activated_per_token
from omni_kernels.quant.dispatch import (
    FP8_MIN_CAPABILITY,
    QUANTIZE_BACKENDS,
    fp8_unsupported_reason,
    quantize_per_token,
    supported_backends,
)
from omni_kernels.quant.gemm import FAST_ACCUM_MAX_K, quantize_weight, resolve_fast_accum, scaled_mm, weight_only_mm
from omni_kernels.quant.gemm_backends import GEMV_MAX_M, LINEAR_BACKENDS, SCALED_MM_ALIGNMENT, WEIGHT_ONLY_BACKENDS
from omni_kernels.quant.gemm_ops import fp8_gemm_plans
from omni_kernels.quant.linear import (
    ACTIVATION_BACKENDS,
    DEFAULT_SPLIT_K,
    QuantizedLinear,
    check_split_k,
    quantized_linear,
    resolve_activation_backend,
)
from omni_kernels.quant.methods import METHOD_DTYPES, QUANT_METHODS
from omni_kernels.quant.reference import (
    FP8_DTYPE,
    FP8_MAX,
    INPUT_ACTIVATIONS,
    INT8_DTYPE,
    INT8_MAX,
    MIN_ABSMAX,
    dequantize,
    quantize_activated_reference,
    quantize_per_token_reference,
)

__all__ = [
    "ACTIVATED_QUANTIZE_BACKENDS",
    "ACTIVATION_BACKENDS",
    "DEFAULT_SPLIT_K",
    "FAST_ACCUM_MAX_K",
    "GEMV_MAX_M",
    "METHOD_DTYPES",
    "check_split_k",
    "INPUT_ACTIVATIONS",
    "quantize_activated_per_token",
    "quantize_activated_reference",
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_MIN_CAPABILITY",
    "INT8_DTYPE",
    "INT8_MAX",
    "LINEAR_BACKENDS",
    "MIN_ABSMAX",
    "QUANTIZE_BACKENDS",
    "QUANT_METHODS",
    "SCALED_MM_ALIGNMENT",
    "WEIGHT_ONLY_BACKENDS",
    "QuantizedLinear",
    "dequantize",
    "fp8_gemm_plans",
    "fp8_unsupported_reason",
    "quantize_per_token",
    "quantize_per_token_reference",
    "quantize_weight",
    "quantized_linear",
    "resolve_activation_backend",
    "resolve_fast_accum",
    "scaled_mm",
    "supported_backends",
    "weight_only_mm",
]
