"""Fused QK-RMSNorm + rotary embedding, as DiT attention blocks apply it.

Backends: ``"cuda"`` (CUDA C++ in ``csrc/qk_norm_rope/``), ``"triton"``
(:mod:`.triton_kernel`) and ``"torch"`` (:mod:`.reference`). See
:func:`qk_rmsnorm_rope`.
"""

from omni_kernels.qk_norm_rope.dispatch import (
    QK_NORM_ROPE_BACKENDS,
    qk_rmsnorm_rope,
    supported_backends,
)
from omni_kernels.qk_norm_rope.reference import qk_rmsnorm_rope_reference

__all__ = [
    "QK_NORM_ROPE_BACKENDS",
    "qk_rmsnorm_rope",
    "qk_rmsnorm_rope_reference",
    "supported_backends",
]
