"""What the routes share: the engines, the file store and the server's settings.

``create_app`` puts one :class:`ServerState` on ``app.state.server``; routes reach it
through the :func:`server_state` dependency.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from fastapi import Request

from omni_serve.engine import Engine, EngineError, Job, QueueFull
from omni_serve.errors import APIError
from omni_serve.files import FileStore
from omni_serve.schemas import VideoCreateRequest, parse_size


@dataclasses.dataclass
class ServerState:
    """The engines (at most one per kind), sharing the first one's metrics."""

    engines: list[Engine]
    files: FileStore
    model_id: str
    default_size: str
    api_key: str | None
    manage_engine: bool

    @property
    def metrics(self):
        return self.engines[0].metrics

    def name_of(self, engine: Engine) -> str:
        return engine.name or self.model_id

    def engine_named(self, name: str, status: int) -> Engine:
        """The engine served as ``name``; APIError ``status`` naming the served models when
        there is none."""
        engine = next((e for e in self.engines if self.name_of(e) == name), None)
        if engine is None:
            names = ", ".join(repr(self.name_of(e)) for e in self.engines)
            raise APIError(status, f"model {name!r} is not served here; this server serves "
                                   f"{names}", param="model", code="model_not_found")
        return engine

    def engine_for(self, req, kind: str) -> Engine:
        """The engine that serves ``req``: the one it names, else the first of ``kind``
        (else the first); APIError when it names none of them, makes another kind, or its
        worker is not ready."""
        if req.model is None:
            engine = next((e for e in self.engines if e.kind == kind), self.engines[0])
        else:
            engine = self.engine_named(req.model, status=400)
        if engine.kind is not None and engine.kind != kind:
            raise APIError(400, f"model {self.name_of(engine)!r} generates {engine.kind}s, "
                                f"not {kind}s", param="model", code="unsupported_model")
        if not engine.ready:
            raise APIError(503, "the model worker is not ready", type="server_error",
                           code="not_ready", headers={"Retry-After": "1"})
        return engine

    def submit(self, req, kind: str, prefix: str, n: int = 1) -> tuple[Engine, Job]:
        """Queue ``req`` on its engine (:meth:`engine_for`): the engine and the new job, or
        APIError 429 when the queue is full, 503 when the worker has failed."""
        engine = self.engine_for(req, kind)
        try:
            return engine, engine.submit(kind, self.params_of(req, n), prefix=prefix)
        except QueueFull as exc:
            raise APIError(429, "the server is busy: the request queue is full; retry later",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(exc.retry_after)}) from None
        except EngineError as exc:
            raise APIError(503, str(exc), type="server_error", code="worker_failed") from None

    def params_of(self, req, n: int = 1) -> dict[str, Any]:
        width, height = parse_size(req.size or self.default_size)
        params = dict(prompt=req.prompt, negative_prompt=req.negative_prompt,
                      num_inference_steps=req.num_inference_steps,
                      guidance_scale=req.guidance_scale, width=width, height=height, n=n,
                      seed=req.seed if req.seed is not None else secrets.randbelow(2**32))
        if isinstance(req, VideoCreateRequest):
            params["num_frames"] = req.frames
        else:  # the worker encodes each image once, in this format
            params["output_format"] = req.output_format
            params["output_compression"] = req.output_compression
        return params

    def video_job(self, video_id: str) -> tuple[Engine, Job]:
        for engine in self.engines:
            job = engine.jobs.get(video_id)
            if job is not None and job.kind == "video":
                return engine, job
        raise APIError(404, f"no video {video_id!r}", param="video_id", code="not_found")


def server_state(request: Request) -> ServerState:
    """The dependency through which routes reach the app's :class:`ServerState`."""
    return request.app.state.server


def size_of(job: Job) -> str:
    return f"{job.params['width']}x{job.params['height']}"
