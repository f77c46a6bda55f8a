"""omni_kernels: attention, quantization and fused kernels for diffusion transformers.

Triton and CUDA C++ kernels with PyTorch references. The compiled part lives in
``omni_kernels._C`` (built from ``csrc/``); without it the Triton and PyTorch
paths still work and compiled-only ops raise an error that says how to build it.
"""

from omni_kernels._extension import has_compiled_extension
from omni_kernels.qk_norm_rope import qk_rmsnorm_rope, qk_rmsnorm_rope_reference
from omni_kernels.quant import QuantizedLinear, quantize_per_token

__version__ = "0.1.0"

__all__ = [
    "QuantizedLinear",
    "__version__",
    "has_compiled_extension",
    "qk_rmsnorm_rope",
    "qk_rmsnorm_rope_reference",
    "quantize_per_token",
]
