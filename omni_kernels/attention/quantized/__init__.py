"""Quantized attention (SageAttention-2 style): INT8 ``Q K^T``, FP8 e4m3 ``P V``. **Lossy.**

* :mod:`.reference`: the exact quantized math in PyTorch (what the kernels compute).
* :mod:`.quantize`: Triton kernels quantizing Q (INT8 per token), K (the mean of a
  strided sample of keys subtracted, INT8 per key block) and V (FP8 per key
  block, transposed), each read once.
* :mod:`.attention_kernel`: the Triton attention kernel on those tensors, and
  :func:`sage_attention_forward` (quantize + attend).
* :mod:`.ops`: the ``torch.library`` op ``omni_kernels::sage_attention_fwd``.

The registry backend is ``omni_sage`` (:mod:`omni_kernels.attention.backends.omni_sage`).
"""

from omni_kernels.attention.quantized.reference import (
    QuantizedQKV,
    quantize_qkv_reference,
    quantized_attention_reference,
    sage_attention_reference,
)

__all__ = [
    "QuantizedQKV",
    "quantize_qkv_reference",
    "quantized_attention_reference",
    "sage_attention_reference",
]
