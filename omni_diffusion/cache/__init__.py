"""Caching across denoising steps: First-Block-Cache and TeaCache (omni's own,
:mod:`.hooks`), cache-dit as a backend (:mod:`.cache_dit`), and the
per-generation state they keep (:mod:`.state`).

Applied through :func:`omni_diffusion.accelerate` with
``AccelConfig(cache=CacheConfig(...))``; statistics of the last call:
:func:`omni_diffusion.last_cache_stats` / ``pipe.omni_stats``, or per request
with :func:`collect_stats`.
"""

from omni_diffusion.cache.hooks import CacheController, relative_l1
from omni_diffusion.cache.state import (
    CacheStats,
    GenerationState,
    branch,
    collect_stats,
    current_generation,
    generation,
)

__all__ = [
    "CacheController",
    "CacheStats",
    "GenerationState",
    "branch",
    "collect_stats",
    "current_generation",
    "generation",
    "relative_l1",
]
