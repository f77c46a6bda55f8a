"""Session-wide gloo worker pools of 2 and 4 ranks (see ``_pool.py``)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _pool import DistPool  # noqa: E402

_POOLS: dict[int, DistPool] = {}


def get_pool(world: int) -> DistPool:
    pool = _POOLS.get(world)
    if pool is None or not pool.alive:
        pool = _POOLS[world] = DistPool(world)
    return pool


@pytest.fixture(scope="session")
def pools():
    yield get_pool
    for pool in _POOLS.values():
        pool.close()
