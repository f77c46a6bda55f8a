"""Batching of requests from concurrent callers into one backend call.

Each caller (a pipeline call in a server thread, say) submits its items and
blocks; one worker thread takes the first waiting submission, waits up to
``window_s`` for others (or until ``max_items`` items are queued), and runs the
backend once on all of them, so N concurrent pipeline calls cost one LLM batch
instead of N. Submissions are never split across batches, so the positive and
negative prompts of one call are always encoded together.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclasses.dataclass
class BatchStats:
    """What the batcher ran: ``batches`` backend calls over ``items`` items from
    ``submissions`` submissions; ``sizes`` lists the items of each batch."""

    batches: int = 0
    submissions: int = 0
    items: int = 0
    sizes: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Pending:
    key: Any
    items: list
    future: Future


class RequestBatcher(Generic[Item, Result]):
    """Runs ``run(key, items) -> results`` (one result per item, same order) on
    batches gathered from concurrent :meth:`submit` calls.

    Args:
        run: the backend call. Only submissions with equal ``key`` share a
            batch (e.g. the prompt format: different templates, or layers,
            cannot run as one request).
        window_s: how long the worker waits for more submissions after the
            first one arrives (0: batch only what is already queued).
        max_items: a batch closes once it holds this many items; a single
            submission larger than that still runs whole.
    """

    def __init__(self, run: Callable[[Any, list], Sequence], window_s: float = 0.005,
                 max_items: int = 256, name: str = "omni-ar-batcher") -> None:
        if not isinstance(window_s, (int, float)) or window_s < 0:
            raise ValueError(f"window_s: {window_s!r} is not allowed; allowed: a number >= 0")
        if isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 1:
            raise ValueError(f"max_items: {max_items!r} is not allowed; allowed: an integer >= 1")
        self._run = run
        self.window_s = float(window_s)
        self.max_items = max_items
        self.stats = BatchStats()
        self._queue: list[_Pending] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: Any, items: Sequence[Item]) -> list[Result]:
        """Queue ``items`` and block until their results are ready.

        Raises whatever the backend raised for the batch that held them.
        """
        items = list(items)
        if not items:
            return []
        pending = _Pending(key, items, Future())
        with self._cond:
            if self._closed:
                raise RuntimeError("the prompt batcher is closed")
            self._queue.append(pending)
            self._cond.notify_all()
        return pending.future.result()

    def close(self) -> None:
        """Stop the worker; submissions still queued fail with RuntimeError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _take_batch(self) -> list[_Pending] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                for pending in self._queue:
                    pending.future.set_exception(RuntimeError("the prompt batcher is closed"))
                self._queue.clear()
                return None
            key = self._queue[0].key
            deadline = time.monotonic() + self.window_s
            while True:
                same = [p for p in self._queue if p.key == key]
                count = sum(len(p.items) for p in same)
                remaining = deadline - time.monotonic()
                if count >= self.max_items or remaining <= 0 or self._closed:
                    break
                self._cond.wait(timeout=remaining)
            batch, size = [], 0
            for pending in list(self._queue):
                if pending.key != key:
                    continue
                if batch and size + len(pending.items) > self.max_items:
                    break
                batch.append(pending)
                size += len(pending.items)
                self._queue.remove(pending)
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            items = [item for pending in batch for item in pending.items]
            self.stats.batches += 1
            self.stats.submissions += len(batch)
            self.stats.items += len(items)
            self.stats.sizes.append(len(items))
            try:
                results = list(self._run(batch[0].key, items))
                if len(results) != len(items):
                    raise RuntimeError(f"the backend returned {len(results)} results for "
                                       f"{len(items)} items")
            except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller
                for pending in batch:
                    pending.future.set_exception(exc)
                continue
            start = 0
            for pending in batch:
                pending.future.set_result(results[start:start + len(pending.items)])
                start += len(pending.items)


__all__ = ["BatchStats", "RequestBatcher"]
