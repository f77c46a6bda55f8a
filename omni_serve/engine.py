"""The engine: a bounded job queue in front of a model worker process.

One worker process (on the CPU; GPU groups and data-parallel replicas are not
implemented yet) runs one job at a time. :meth:`Engine.submit` raises
:class:`QueueFull` when ``max_queue`` jobs already wait beside the running one,
so the HTTP layer answers 429. Every job has an asyncio queue of events
(``progress`` per denoising step, then one terminal event: ``done``,
``error`` or ``cancelled``). A dispatcher thread reads the worker's events; when
the worker dies, the job it was running fails with an error (never a hang) and
a new worker is started for the jobs still queued.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import multiprocessing as mp
import os
import queue
import secrets
import threading
import time
from typing import Any

from omni_serve import metrics as m

logger = logging.getLogger("omni_serve.engine")

TERMINAL = ("done", "error", "cancelled")


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__("the request queue is full")
        self.retry_after = retry_after


class EngineError(Exception):
    pass


@dataclasses.dataclass
class Job:
    id: str
    kind: str
    params: dict[str, Any]
    created: float = dataclasses.field(default_factory=time.time)
    status: str = "queued"  # queued, in_progress, completed, failed, cancelled
    step: int = 0
    total: int | None = None
    result: dict[str, Any] | None = None
    error: tuple[str, str] | None = None
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    started: float | None = None
    finished: float | None = None

    @property
    def done(self) -> bool:
        return self.status in ("completed", "failed", "cancelled")

    @property
    def progress(self) -> float:
        if self.status == "completed":
            return 1.0
        return 0.0 if not self.total else min(1.0, self.step / self.total)


class Engine:
    """Owns the worker process and the jobs.

    Args:
        model: a diffusers folder or hub id, or None for the embedded default model of ``kind``.
        kind: ``"image"`` or ``"video"``: what the model makes (None: found when it loads).
        name: the model id clients see (``/v1/models``, a request's ``model``).
        accel: an ``AccelConfig.to_dict()`` to apply in the worker, or None.
        max_queue: jobs that may wait beside the running one.
        metrics: the :class:`omni_serve.metrics.Metrics` to update.
    """

    def __init__(self, model: str | None, accel: dict | None = None, *, kind: str | None = None,
                 name: str | None = None, max_queue: int = 16,
                 device: str = "cpu", dtype: str = "float32", metrics: m.Metrics | None = None,
                 startup_timeout: float = 300.0, keep_videos_s: float = 3600.0) -> None:
        self.model = model
        self.kind = kind
        self.name = name
        self.accel = accel
        self.max_queue = max_queue
        self.device = device
        self.dtype = dtype
        self.metrics = metrics or m.Metrics()
        self.startup_timeout = startup_timeout
        self.keep_videos_s = keep_videos_s
        self.jobs: dict[str, Job] = {}
        self.info: dict[str, Any] | None = None
        self.ready = False
        self.fatal: str | None = None
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._running: str | None = None
        self._stopping = False
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready_event = threading.Event()
        self._job_seconds = 1.0
        self._counter = itertools.count()

    # ------------------------------------------------------------------ lifecycle

    def _spawn(self) -> None:
        from omni_serve.worker import run_worker

        self._jobs_q = self._ctx.Queue()
        self._control_q = self._ctx.Queue()
        self._events_q = self._ctx.Queue()
        self._proc = self._ctx.Process(
            target=run_worker, name="omni-serve-worker", daemon=True,
            args=(self.model, self.accel, self.device, self.dtype,
                  self._jobs_q, self._control_q, self._events_q, self.kind, os.getpid()),
        )
        self._proc.start()
        # jobs that were queued with the dead worker go to the new one
        for job in self.jobs.values():
            if job.status == "queued":
                self._jobs_q.put(("run", job.id, job.kind, job.params))

    async def start(self, wait: bool = True) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn()
        self._thread = threading.Thread(target=self._dispatch, name="omni-serve-dispatch",
                                        daemon=True)
        self._thread.start()
        if wait:
            await self._loop.run_in_executor(None, self._ready_event.wait, self.startup_timeout)
            if self.fatal:
                raise EngineError(f"the model worker failed to start: {self.fatal}")
            if not self.ready:
                raise EngineError("the model worker did not start in time")

    async def stop(self, drain_timeout: float = 30.0) -> None:
        """Let in-flight work finish (up to ``drain_timeout``), then stop the worker."""
        self._draining = True
        deadline = time.monotonic() + drain_timeout
        while any(not j.done for j in self.jobs.values()) and time.monotonic() < deadline \
                and self._proc is not None and self._proc.is_alive():
            await asyncio.sleep(0.05)
        self._stopping = True
        for job in list(self.jobs.values()):
            if not job.done:
                self._finish(job, "error", ("server_error", "the server is shutting down"))
        if self._proc is not None:
            try:
                self._jobs_q.put(("stop",))
            except Exception:  # noqa: BLE001
                pass
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        if self._thread is not None:
            self._thread.join(2)

    @property
    def worker_pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def kill_worker(self) -> None:
        """Kill the worker process (tests: a worker dying mid-request)."""
        if self._proc is not None:
            self._proc.kill()

    # ------------------------------------------------------------------ jobs

    @property
    def queue_depth(self) -> int:
        return sum(1 for j in self.jobs.values() if j.status == "queued")

    def _active(self) -> int:
        return sum(1 for j in self.jobs.values() if not j.done)

    def submit(self, kind: str, params: dict[str, Any], prefix: str = "req") -> Job:
        if self.fatal:
            raise EngineError(f"the model worker failed: {self.fatal}")
        if self._active() >= self.max_queue + 1:
            waiting = self._active()
            raise QueueFull(max(1, math.ceil(self._job_seconds * waiting)))
        job = Job(id=f"{prefix}_{secrets.token_hex(12)}", kind=kind, params=params)
        self.jobs[job.id] = job
        self._jobs_q.put(("run", job.id, kind, params))
        self.metrics.queue_depth.set(self.queue_depth)
        return job

    def cancel(self, job_id: str) -> bool:
        job = self.jobs.get(job_id)
        if job is None or job.done:
            return False
        self._control_q.put(job_id)
        self._finish(job, "cancelled", None)
        return True

    def forget(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)

    def _finish(self, job: Job, what: str, payload: Any) -> None:
        if job.done:
            return
        job.finished = time.time()
        if what == "done":
            job.status, job.result = "completed", payload
            job.step = job.total or job.step
        elif what == "error":
            job.status, job.error = "failed", payload
        else:
            job.status = "cancelled"
        if self._running == job.id and what != "cancelled":
            self._running = None
        job.events.put_nowait((what, payload))
        self.metrics.jobs.labels(job.kind, job.status).inc()
        self.metrics.queue_depth.set(self.queue_depth)
        self._prune()

    def _prune(self) -> None:
        """Drop finished jobs nobody fetched: images after 10 minutes, videos after keep_videos_s."""
        now = time.time()
        for job_id in [j.id for j in self.jobs.values() if j.done and now - (j.finished or now)
                       > (self.keep_videos_s if j.kind == "video" else 600.0)]:
            self.jobs.pop(job_id, None)

    # ------------------------------------------------------------------ events

    def _on_event(self, message: tuple) -> None:
        what = message[0]
        if what == "ready":
            self.info = message[1]
            self.kind = self.info.get("kind", self.kind)
            self.ready = True
            self._ready_event.set()
            return
        if what == "fatal":
            self.fatal = message[1]
            self.ready = False
            self._ready_event.set()
            for job in list(self.jobs.values()):
                if not job.done:
                    self._finish(job, "error", ("server_error", f"the model worker failed: {message[1]}"))
            return
        if what == "worker_died":
            self.ready = False
            if self._running is not None:
                job = self.jobs.get(self._running)
                self._running = None
                if job is not None:
                    self._finish(job, "error", ("server_error",
                                                "the model worker died while running this request"))
            return
        job = self.jobs.get(message[1])
        if job is None:
            return
        if what == "start":
            self._running = job.id
            if not job.done:
                job.status = "in_progress"
                job.started = time.time()
            self.metrics.queue_depth.set(self.queue_depth)
            self.metrics.batch_size.observe(1)
        elif what == "progress":
            _, _, step, total, seconds = message
            self.metrics.step_seconds.observe(seconds)
            if not job.done:
                job.step, job.total = step, total
                job.events.put_nowait(("progress", {"step": step, "total": total}))
        elif what == "done":
            started = job.started
            if started is not None:
                self._job_seconds = 0.7 * self._job_seconds + 0.3 * (time.time() - started)
            if self._running == job.id:
                self._running = None
            self._finish(job, "done", message[2])
        elif what == "error":
            if self._running == job.id:
                self._running = None
            self._finish(job, "error", (message[2], message[3]))
        elif what == "cancelled":
            if self._running == job.id:
                self._running = None
            self._finish(job, "cancelled", None)

    def _post(self, message: tuple) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._on_event, message)
            except RuntimeError:  # loop closed meanwhile
                pass

    def _dispatch(self) -> None:
        while not self._stopping:
            try:
                message = self._events_q.get(timeout=0.2)
            except queue.Empty:
                proc = self._proc
                if proc is not None and not proc.is_alive() and not self._stopping:
                    if self.fatal:
                        return
                    logger.error("the model worker died (exit code %s); restarting it",
                                 proc.exitcode)
                    self.metrics.worker_restarts.inc()
                    self._post(("worker_died",))
                    if self._draining:
                        return
                    time.sleep(0.1)  # let the loop fail the running job first
                    self._restart_from_thread()
                continue
            except (EOFError, OSError):
                continue
            self._post(message)
            if message[0] == "fatal":
                return

    def _restart_from_thread(self) -> None:
        done = threading.Event()

        def restart() -> None:
            try:
                self._spawn()
            finally:
                done.set()

        self._loop.call_soon_threadsafe(restart)
        done.wait(30)
