"""The engine: a bounded job queue in front of one or more model worker processes.

Jobs wait in the engine (not in the workers) until a worker is free; then
:func:`omni_serve.batching.select_batch` takes the oldest job and the compatible jobs
queued behind it (up to ``max_batch`` images) and the worker runs them as one pipeline
call. ``batch_wait_s`` lets a free worker wait that long after a job arrives for
compatible jobs to join it (0: batch only what is already queued).

Data-parallel replicas: one worker process per device group
(:func:`omni_serve.batching.plan_replicas`); a batch goes to any free replica.
:meth:`Engine.submit` raises :class:`QueueFull` when ``max_queue`` jobs already wait, so
the HTTP layer answers 429. Every job has an asyncio queue of events (``progress`` per
denoising step, then one terminal event: ``done``, ``error`` or ``cancelled``). A
dispatcher thread per replica reads its worker's events; when a worker dies, the jobs
it was running fail with an error (never a hang) and a new worker is started.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
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
from omni_serve.batching import rows_of, select_batch, visible_devices

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
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    replica: int | None = None

    @property
    def done(self) -> bool:
        return self.status in ("completed", "failed", "cancelled")

    @property
    def progress(self) -> float:
        if self.status == "completed":
            return 1.0
        return 0.0 if not self.total else min(1.0, self.step / self.total)


@dataclasses.dataclass
class _Replica:
    """One worker process and its queues; ``running`` holds the ids of the batch it was
    given, until it reports ``idle``."""

    index: int
    devices: tuple[int, ...] | None
    proc: Any = None
    jobs_q: Any = None
    control_q: Any = None
    events_q: Any = None
    thread: threading.Thread | None = None
    ready: bool = False
    running: list[str] = dataclasses.field(default_factory=list)
    info: dict[str, Any] | None = None  # the worker's "ready" report


@dataclasses.dataclass(eq=False, repr=False)
class Engine:
    """Owns the worker processes and the jobs.

    Args:
        model: a diffusers folder or hub id, or None for the embedded default model of ``kind``.
        accel: an ``AccelConfig.to_dict()`` to apply in the worker, or None.
        kind: ``"image"`` or ``"video"``: what the model makes (None: found when it loads).
        name: the model id clients see (``/v1/models``, a request's ``model``).
        max_queue: jobs that may wait for a worker; more get :class:`QueueFull`.
        device: ``"cpu"`` or ``"cuda"``: what the workers run on.
        metrics: the :class:`omni_serve.metrics.Metrics` to update (default: a new one).
        placement: the device group of each replica
            (:func:`omni_serve.batching.plan_replicas`); default one worker on ``device``.
        max_batch: images one pipeline call may hold (1: no batching).
        batch_wait_s: how long a free worker waits for compatible jobs to join the oldest.
    """

    model: str | None
    accel: dict | None = None
    _: dataclasses.KW_ONLY
    kind: str | None = None
    name: str | None = None
    max_queue: int = 16
    device: str = "cpu"
    dtype: str = "float32"
    metrics: m.Metrics | None = None
    placement: list[tuple[int, ...] | None] | None = None
    max_batch: int = 8
    batch_wait_s: float = 0.0
    startup_timeout: float = 300.0
    keep_videos_s: float = 3600.0

    def __post_init__(self) -> None:
        max_batch, batch_wait_s = self.max_batch, self.batch_wait_s
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch: {max_batch!r} is not allowed; allowed: an integer >= 1")
        if not isinstance(batch_wait_s, (int, float)) or not 0 <= batch_wait_s <= 10:
            raise ValueError(f"batch_wait_s: {batch_wait_s!r} is not allowed; "
                             "allowed: 0 to 10 seconds")
        self.batch_wait_s = float(batch_wait_s)
        if self.metrics is None:
            self.metrics = m.Metrics()
        self.jobs: dict[str, Job] = {}
        self._queued: collections.deque[Job] = collections.deque()
        self.info: dict[str, Any] | None = None
        self.ready = False
        self.fatal: str | None = None
        self._ctx = mp.get_context("spawn")
        self.replicas = [_Replica(i, group) for i, group in enumerate(self.placement or [None])]
        self._stopping = False
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready_event = threading.Event()
        self._job_seconds = 1.0
        self._wakeup: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ lifecycle

    def _spawn(self, replica: _Replica) -> None:
        from omni_serve.worker import run_worker

        replica.jobs_q = self._ctx.Queue()
        replica.control_q = self._ctx.Queue()
        replica.events_q = self._ctx.Queue()
        replica.running = []
        visible, device = None, self.device
        if replica.devices is not None:
            # the worker sees only its group, so inside it the group starts at cuda:0
            visible = visible_devices(replica.devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
            device = "cuda"
        replica.proc = self._ctx.Process(
            target=run_worker, name=f"omni-serve-worker-{replica.index}", daemon=True,
            args=(self.model, self.accel, device, self.dtype, replica.jobs_q,
                  replica.control_q, replica.events_q, self.kind, os.getpid(), visible),
        )
        replica.proc.start()

    async def start(self, wait: bool = True) -> None:
        self._loop = asyncio.get_running_loop()
        for replica in self.replicas:
            self._spawn(replica)
            replica.thread = threading.Thread(target=self._dispatch, args=(replica,),
                                              name=f"omni-serve-dispatch-{replica.index}",
                                              daemon=True)
            replica.thread.start()
        if wait:
            await self._loop.run_in_executor(None, self._ready_event.wait, self.startup_timeout)
            if self.fatal:
                raise EngineError(f"the model worker failed to start: {self.fatal}")
            if not self.ready:
                raise EngineError("the model worker did not start in time")

    async def stop(self, drain_timeout: float = 30.0) -> None:
        """Let in-flight work finish (up to ``drain_timeout``), then stop the workers."""
        self._draining = True
        deadline = time.monotonic() + drain_timeout
        while any(not j.done for j in self.jobs.values()) and time.monotonic() < deadline \
                and any(r.proc is not None and r.proc.is_alive() for r in self.replicas):
            await asyncio.sleep(0.05)
        self._stopping = True
        for job in list(self.jobs.values()):
            if not job.done:
                self._finish(job, "error", ("server_error", "the server is shutting down"))
        for replica in self.replicas:
            if replica.proc is None:
                continue
            try:
                replica.jobs_q.put(("stop",))
            except Exception:  # noqa: BLE001
                pass
        for replica in self.replicas:
            if replica.proc is None:
                continue
            replica.proc.join(5)
            if replica.proc.is_alive():
                replica.proc.kill()
                replica.proc.join(5)
            if replica.thread is not None:
                replica.thread.join(2)

    @property
    def worker_pid(self) -> int | None:
        """The first replica's worker process id."""
        proc = self.replicas[0].proc
        return None if proc is None else proc.pid

    @property
    def replica_status(self) -> list[dict[str, Any]]:
        """Per replica: its worker's pid, readiness, device group and the GPUs it sees."""
        return [{"replica": r.index, "pid": None if r.proc is None else r.proc.pid,
                 "ready": r.ready, "devices": r.devices, "running": len(r.running),
                 "visible_devices": (r.info or {}).get("visible_devices"),
                 "gpus": (r.info or {}).get("gpus", [])} for r in self.replicas]

    @property
    def worker_pids(self) -> list[int | None]:
        return [None if r.proc is None else r.proc.pid for r in self.replicas]

    def kill_worker(self, replica: int = 0) -> None:
        """Kill a worker process (tests: a worker dying mid-request)."""
        proc = self.replicas[replica].proc
        if proc is not None:
            proc.kill()

    # ------------------------------------------------------------------ jobs

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for a worker."""
        return sum(1 for j in self._queued if not j.done)

    def _active(self) -> int:
        return sum(1 for j in self.jobs.values() if not j.done)

    def submit(self, kind: str, params: dict[str, Any], prefix: str = "req") -> Job:
        if self.fatal:
            raise EngineError(f"the model worker failed: {self.fatal}")
        waiting = self.queue_depth
        # free replicas take up to max_batch images each at once (inside a batching window,
        # jobs wait for them); beyond that, max_queue may wait
        if waiting >= self.max_queue + self.max_batch * len(self._idle_replicas()):
            per_call = self._job_seconds / max(1, len(self.replicas))
            raise QueueFull(max(1, math.ceil(per_call * (1 + waiting / self.max_batch))))
        job = Job(id=f"{prefix}_{secrets.token_hex(12)}", kind=kind, params=params)
        self.jobs[job.id] = job
        self._queued.append(job)
        self._schedule()
        self.metrics.queue_depth.set(self.queue_depth)
        return job

    def cancel(self, job_id: str) -> bool:
        job = self.jobs.get(job_id)
        if job is None or job.done:
            return False
        if job.replica is not None:  # running: the worker stops it at the next step
            self.replicas[job.replica].control_q.put(job_id)
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

    # ------------------------------------------------------------------ scheduling

    def _idle_replicas(self) -> list[_Replica]:
        return [r for r in self.replicas if r.ready and not r.running]

    def _schedule(self) -> None:
        """Give each free replica the next batch (on the event loop's thread)."""
        while self._queued and self._queued[0].done:  # cancelled while queued
            self._queued.popleft()
        for replica in self._idle_replicas():
            queued = [j for j in self._queued if not j.done]
            if not queued:
                return
            batch = select_batch(queued, self.max_batch)
            rows = sum(rows_of(j.params) for j in batch)
            wait = queued[0].submitted + self.batch_wait_s - time.monotonic()
            if wait > 0 and rows < self.max_batch:
                # let compatible requests arriving within the window join this batch
                if self._wakeup is None and self._loop is not None:
                    self._wakeup = self._loop.call_later(wait, self._wake)
                return
            taken = {j.id for j in batch}
            self._queued = collections.deque(j for j in self._queued if j.id not in taken)
            for job in batch:
                job.replica = replica.index
            replica.running = [j.id for j in batch]
            replica.jobs_q.put(("run", [(j.id, j.kind, j.params) for j in batch]))
        self.metrics.queue_depth.set(self.queue_depth)

    def _wake(self) -> None:
        self._wakeup = None
        self._schedule()

    # ------------------------------------------------------------------ events

    def _on_event(self, message: tuple, replica: int = 0) -> None:
        """Handle one worker event (on the event loop's thread)."""
        what = message[0]
        rep = self.replicas[replica]
        if what == "ready":
            self.info = message[1]
            rep.info = message[1]
            self.kind = self.info.get("kind", self.kind)
            rep.ready = True
            self.ready = True
            if all(r.ready for r in self.replicas):
                self._ready_event.set()
            self._schedule()
            return
        if what == "fatal":
            self.fatal = message[1]
            rep.ready = False
            self.ready = False
            self._ready_event.set()
            for job in list(self.jobs.values()):
                if not job.done:
                    self._finish(job, "error", ("server_error", f"the model worker failed: {message[1]}"))
            return
        if what == "worker_died":
            rep.ready = False
            self.ready = any(r.ready for r in self.replicas)
            for job_id in rep.running:
                job = self.jobs.get(job_id)
                if job is not None:
                    self._finish(job, "error", ("server_error",
                                                "the model worker died while running this request"))
            rep.running = []
            return
        if what == "idle":
            rep.running = []
            self._schedule()
            return
        if what == "batch":
            ids = message[1]
            self.metrics.batch_size.observe(len(ids))
            self.metrics.replica_batches.labels(str(replica)).inc()
            for job_id in ids:
                job = self.jobs.get(job_id)
                if job is not None and not job.done:
                    job.status = "in_progress"
                    job.started = job.started or time.time()
            self.metrics.queue_depth.set(self.queue_depth)
            return
        if what == "progress":
            _, ids, step, total, seconds = message
            self.metrics.step_seconds.observe(seconds)
            for job_id in ids:
                job = self.jobs.get(job_id)
                if job is not None and not job.done:
                    job.step, job.total = step, total
                    job.events.put_nowait(("progress", {"step": step, "total": total}))
            return
        if what == "stats":
            encoder = message[1].get("prompt_encoder")
            if encoder is not None:
                for field, value in encoder.items():
                    self.metrics.prompt_encoder.labels(str(replica), field).set(value)
            return
        job = self.jobs.get(message[1])
        if job is None:
            return
        if what == "done":
            started = job.started
            if started is not None:
                self._job_seconds = 0.7 * self._job_seconds + 0.3 * (time.time() - started)
            self._finish(job, "done", message[2])
        elif what == "error":
            self._finish(job, "error", (message[2], message[3]))
        elif what == "cancelled":
            self._finish(job, "cancelled", None)

    def _post(self, message: tuple, replica: int) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._on_event, message, replica)
            except RuntimeError:  # loop closed meanwhile
                pass

    def _dispatch(self, replica: _Replica) -> None:
        """Read one replica's events; restart its worker when it dies."""
        while not self._stopping:
            try:
                message = replica.events_q.get(timeout=0.2)
            except queue.Empty:
                proc = replica.proc
                if proc is not None and not proc.is_alive() and not self._stopping:
                    if self.fatal:
                        return
                    logger.error("model worker %d died (exit code %s); restarting it",
                                 replica.index, proc.exitcode)
                    self.metrics.worker_restarts.inc()
                    self._post(("worker_died",), replica.index)
                    if self._draining:
                        return
                    time.sleep(0.1)  # let the loop fail the running jobs first
                    self._restart_from_thread(replica)
                continue
            except (EOFError, OSError):
                continue
            self._post(message, replica.index)
            if message[0] == "fatal":
                return

    def _restart_from_thread(self, replica: _Replica) -> None:
        done = threading.Event()

        def restart() -> None:
            try:
                self._spawn(replica)
            finally:
                done.set()

        self._loop.call_soon_threadsafe(restart)
        done.wait(30)
