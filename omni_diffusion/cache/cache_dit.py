"""cache-dit (the ``cache-dit`` package, ``import cache_dit``) as a cache backend.

``CacheConfig(kind="cache_dit")`` maps onto cache-dit's DBCache with one
compute block in front (``Fn_compute_blocks=1, Bn_compute_blocks=0``: the
First-Block-Cache shape), omni's threshold, warm-up and consecutive-hit limit;
``CacheConfig.options`` overrides or adds any ``cache_dit.DBCacheConfig``
field. cache-dit keeps its state on the pipeline (it resets per call itself),
so unlike omni's own caches it does not isolate concurrent calls on one pipeline.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from omni_diffusion.config import CacheConfig

logger = logging.getLogger("omni_diffusion.cache")


def _import_cache_dit():
    try:
        return importlib.import_module("cache_dit")
    except ImportError as exc:
        raise ImportError(
            "cache='cache_dit' needs the cache-dit package, which is not installed "
            f"({exc}); install it (pip install cache-dit, or omni's [peers] extra) or use "
            "cache='first_block' / 'teacache' (omni's own)"
        ) from exc


def enable(pipe: Any, config: CacheConfig, cfg_mode: str, warmup_steps: int):
    """Enable cache-dit on ``pipe``; returns the undo."""
    cache_dit = _import_cache_dit()
    fields: dict[str, Any] = dict(
        Fn_compute_blocks=1,
        Bn_compute_blocks=0,
        residual_diff_threshold=config.threshold,
        max_warmup_steps=warmup_steps,
        max_continuous_cached_steps=config.max_consecutive_hits or -1,
    )
    if cfg_mode == "separate":
        fields["enable_separate_cfg"] = True
    elif cfg_mode == "batched":
        fields["enable_separate_cfg"] = False
    fields.update(config.options)
    cache_config = cache_dit.DBCacheConfig(**fields)
    cache_dit.enable_cache(pipe, cache_config=cache_config)

    def undo() -> None:
        cache_dit.disable_cache(pipe)

    return undo


def summary(pipe: Any) -> Any:
    """cache-dit's own statistics for ``pipe`` (None when unavailable)."""
    try:
        cache_dit = _import_cache_dit()
        return cache_dit.summary(pipe)
    except Exception as exc:  # noqa: BLE001 - stats are best effort
        logger.debug("cache_dit.summary failed: %s", exc)
        return None
