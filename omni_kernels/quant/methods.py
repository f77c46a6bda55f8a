"""The quantization methods of a linear layer and the 8-bit dtype of each one's weight.

``"fp8"`` and ``"int8"`` are W8A8 (the input is quantized per token too); the
``*_weight_only`` methods quantize the weight only.
"""

from __future__ import annotations

from omni_kernels.quant.reference import FP8_DTYPE, INT8_DTYPE

QUANT_METHODS = ("fp8", "int8", "fp8_weight_only", "int8_weight_only")
METHOD_DTYPES = {
    "fp8": FP8_DTYPE,
    "int8": INT8_DTYPE,
    "fp8_weight_only": FP8_DTYPE,
    "int8_weight_only": INT8_DTYPE,
}
