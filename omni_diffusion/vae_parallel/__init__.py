"""VAE parallelism: tile-parallel encode/decode and spatially-sharded decode over a process group.

:func:`parallelize_vae` (``mode="tile" | "spatial" | "auto"``) and :func:`unparallelize_vae`;
one module per concern: :mod:`.tile`, :mod:`.spatial` (layer wrappers), :mod:`.halo_exchange`,
:mod:`.sharding`, :mod:`.mode` (the ``auto`` choice), :mod:`.families` (supported VAE classes
and their layer roles), :mod:`.memory` (peak activation memory on any device).
"""

from omni_diffusion.vae_parallel.memory import PeakMemoryTracker
from omni_diffusion.vae_parallel.mode import VAE_PARALLEL_MODES, choose_decode_mode
from omni_diffusion.vae_parallel.parallelize import (
    parallelize_vae,
    unparallelize_vae,
    vae_parallel_mode,
)
from omni_diffusion.vae_parallel.spatial import distributed_group_norm

__all__ = [
    "VAE_PARALLEL_MODES",
    "PeakMemoryTracker",
    "choose_decode_mode",
    "distributed_group_norm",
    "parallelize_vae",
    "unparallelize_vae",
    "vae_parallel_mode",
]
