"""Peak activation memory of a region of code, on any device (CPU included).

``torch.cuda.max_memory_allocated`` only exists on CUDA; the tests run on CPU with gloo, so this
counts the bytes of every tensor storage created inside the region while it is alive (a
``TorchDispatchMode`` sees each op's outputs; a finalizer on the storage sees it freed).
Parameters and tensors created before the region do not count.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakMemoryTracker(TorchDispatchMode):
    """``with PeakMemoryTracker() as t: ...`` then ``t.peak_bytes``: the most bytes of storages
    created in the region that were alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._seen: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self.live_bytes -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # A view (or an out= argument) shares an input's storage: not a new allocation.
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self._seen or key in inputs:
                continue
            self._seen.add(key)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._release, key, nbytes)
        return out
