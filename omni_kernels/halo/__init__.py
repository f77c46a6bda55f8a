"""Halo pack / assemble: the boundary-row copies of a spatially-sharded convolution.

Backends: ``"cuda"`` (CUDA C++ in ``csrc/halo/``), ``"triton"`` (:mod:`.triton_kernel`) and
``"torch"`` (:mod:`.reference`). See :func:`halo_pack` and :func:`halo_assemble`.
"""

from omni_kernels.halo.dispatch import HALO_BACKENDS, halo_assemble, halo_pack
from omni_kernels.halo.reference import (
    HALO_MODES,
    HALO_RECV,
    HALO_REPLICATE,
    HALO_ZERO,
    halo_assemble_reference,
    halo_pack_reference,
)

__all__ = [
    "HALO_BACKENDS",
    "HALO_MODES",
    "HALO_RECV",
    "HALO_REPLICATE",
    "HALO_ZERO",
    "halo_assemble",
    "halo_assemble_reference",
    "halo_pack",
    "halo_pack_reference",
]
