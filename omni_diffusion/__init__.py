"""omni_diffusion: the runtime that applies omni's kernels to diffusers pipelines.

It composes attention backends, quantization, caching, compilation and
parallelism on top of ``omni_kernels``; it never imports ``omni_serve``.

The main entry point::

    import omni_diffusion as od
    pipe = od.accelerate(pipe, od.AccelConfig(attention="auto", compile=True,
                                              cache=od.CacheConfig("first_block")))
    od.undo(pipe)

See :mod:`omni_diffusion.accelerate`, :mod:`omni_diffusion.config`,
:mod:`omni_diffusion.adapters` (one module per model family) and
:mod:`omni_diffusion.cache`.
"""

__version__ = "0.1.0"

from omni_diffusion.accelerate import (  # noqa: E402
    accel_config,
    accelerate,
    is_accelerated,
    last_cache_stats,
    step_callback,
    undo,
)
from omni_diffusion.cache.state import CacheStats, collect_stats  # noqa: E402
from omni_diffusion.config import AccelConfig, CacheConfig  # noqa: E402
from omni_diffusion.parallel.config import ParallelConfig  # noqa: E402

__all__ = [
    "AccelConfig",
    "CacheConfig",
    "CacheStats",
    "ParallelConfig",
    "__version__",
    "accel_config",
    "accelerate",
    "collect_stats",
    "is_accelerated",
    "last_cache_stats",
    "step_callback",
    "undo",
]
