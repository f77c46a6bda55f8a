"""The FastAPI application: OpenAI-style image and video endpoints over an :class:`Engine`.

``create_app(engines, api_key=...)`` builds it over one :class:`Engine` or several (one
per kind: the embedded image and video models); the engines' workers start in the
app's lifespan (or are started by the caller when ``manage_engine=False``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import secrets
from typing import Any, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException

from omni_serve.engine import Engine, EngineError, Job, QueueFull
from omni_serve.errors import APIError, _param_of
from omni_serve.files import FileStore
from omni_serve.media import (
    FPS,
    IMAGE_MEDIA_TYPES,
    encode_apng,
    encode_mp4,
    encode_spritesheet,
)
from omni_serve.metrics import CONTENT_TYPE_LATEST
from omni_serve.middleware import _Observe
from omni_serve.schemas import (
    MAX_BODY_BYTES,
    ImageGenerationRequest,
    VideoCreateRequest,
    error_body,
    parse_size,
    seconds_of,
)


def create_app(engines: Engine | list[Engine], *, api_key: str | None = None, model_id: str = "omni",
               default_size: str = "1024x1024", file_ttl: float = 3600.0,
               manage_engine: bool = True) -> FastAPI:
    """The app serving ``engines`` (one :class:`Engine` or a list, at most one per kind).

    Args:
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <key>`` (401 otherwise).
        model_id: the id ``/v1/models`` lists and requests may name, for engines without
            their own ``name``.
        default_size: ``"WxH"`` used when a request gives no size.
        file_ttl: seconds a ``response_format="url"`` file stays available.
        manage_engine: start and stop the engine in the app's lifespan.
    """
    parse_size(default_size)
    files = FileStore(file_ttl)
    engines = [engines] if isinstance(engines, Engine) else list(engines)
    if not engines:
        raise ValueError("create_app needs at least one engine")
    metrics = engines[0].metrics
    for other in engines[1:]:
        other.metrics = metrics

    def name_of(engine: Engine) -> str:
        return engine.name or model_id

    def engine_for(kind: str) -> Engine:
        for engine in engines:
            if engine.kind == kind:
                return engine
        return engines[0]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            await asyncio.gather(*(engine.start() for engine in engines))
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.gather(*(engine.stop() for engine in engines))
            files.close()

    app = FastAPI(title="omni-serve", version="0.1.0", lifespan=lifespan)
    app.state.engines, app.state.files = engines, files
    app.add_middleware(_Observe, metrics=metrics, max_body=MAX_BODY_BYTES)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _param_of(tuple(first.get("loc", ())))
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            message = "unknown field"
        elif first.get("type") in ("json_invalid", "model_attributes_type", "dict_type", "model_type"):
            message = "the body must be a JSON object"
        text = f"{param}: {message}" if param else message
        return APIError(400, text, param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail),
                        code="not_found" if exc.status_code == 404 else None,
                        headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return exc.response()

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    # ------------------------------------------------------------------ plain

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/health/ready")
    async def ready():
        workers = [{"model": name_of(e), "kind": e.kind, "ready": e.ready,
                    "queue_depth": e.queue_depth, "worker_pid": e.worker_pid,
                    "worker_pids": e.worker_pids, "replicas": e.replica_status,
                    "max_batch": e.max_batch, "error": e.fatal}
                   for e in engines]
        ok = all(e.ready for e in engines)
        body = {"status": "ready" if ok else "not_ready", "workers": workers,
                "queue_depth": sum(e.queue_depth for e in engines),
                "worker_pid": engines[0].worker_pid}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_endpoint():
        metrics.queue_depth.set(sum(e.queue_depth for e in engines))
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        from omni_serve.playground import PAGE

        return HTMLResponse(PAGE)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {"object": "list", "data": [{
            "id": name_of(e), "object": "model", "created": 0, "owned_by": "omni",
            "kind": e.kind, "pipeline": (e.info or {}).get("pipeline"),
        } for e in engines]}

    @app.get("/v1/files/{name}")
    async def get_file(name: str):
        entry = files.get(name)
        if entry is None:
            raise APIError(404, "no such file (or it expired)", code="not_found")
        with open(entry[0], "rb") as f:
            return Response(f.read(), media_type=entry[1])

    # ------------------------------------------------------------------ helpers

    def check_model(req, kind: str) -> Engine:
        names = [name_of(e) for e in engines]
        if req.model is not None and req.model not in names:
            raise APIError(400, f"model {req.model!r} is not served here; this server serves "
                                f"{', '.join(map(repr, names))}", param="model",
                           code="model_not_found")
        engine = engine_for(kind)
        if req.model is not None:
            engine = next(e for e in engines if name_of(e) == req.model)
        served = engine.kind
        if served is not None and served != kind:
            raise APIError(400, f"model {name_of(engine)!r} generates {served}s, not {kind}s",
                           param="model", code="unsupported_model")
        if not engine.ready:
            raise APIError(503, "the model worker is not ready", type="server_error",
                           code="not_ready", headers={"Retry-After": "1"})
        return engine

    def params_of(req, n: int = 1) -> dict[str, Any]:
        width, height = parse_size(req.size or default_size)
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

    def size_of(job: Job) -> str:
        return f"{job.params['width']}x{job.params['height']}"

    def submit(engine: Engine, kind: str, params: dict, prefix: str) -> Job:
        try:
            return engine.submit(kind, params, prefix=prefix)
        except QueueFull as exc:
            raise APIError(429, "the server is busy: the request queue is full; retry later",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(exc.retry_after)}) from None
        except EngineError as exc:
            raise APIError(503, str(exc), type="server_error", code="worker_failed") from None

    def job_error(job: Job) -> APIError:
        if job.status == "cancelled":
            return APIError(499, "the request was cancelled", code="cancelled")
        etype, message = job.error or ("server_error", "unknown error")
        status = 400 if etype == "invalid_request_error" else 500
        return APIError(status, message, type=etype, code="generation_failed")

    def image_payload(job: Job, request: Request, req: ImageGenerationRequest) -> dict:
        """OpenAI's images response: each image (encoded by the worker in req.output_format)
        inline or as a file."""
        data = []
        for image in job.result["images"]:
            if req.response_format == "url":
                name = files.put(image, req.output_format, IMAGE_MEDIA_TYPES[req.output_format])
                data.append({"url": str(request.base_url) + f"v1/files/{name}"})
            else:
                data.append({"b64_json": base64.b64encode(image).decode()})
        return {"created": int(job.created), "data": data, "output_format": req.output_format,
                "size": size_of(job)}

    def server_timing(job: Job) -> str:
        """``queue`` (submitted to the start of its pipeline call) and ``engine`` (the
        pipeline call), in ms: what a client can subtract to see the server's own overhead."""
        queued = max(0.0, (job.started or job.created) - job.created)
        engine_s = (job.result or {}).get("engine_seconds", 0.0)
        return f"queue;dur={queued * 1000:.2f}, engine;dur={engine_s * 1000:.2f}"

    # ------------------------------------------------------------------ images

    @app.post("/v1/images/generations", dependencies=[Depends(authorize)])
    async def images_generations(req: ImageGenerationRequest, request: Request):
        engine = check_model(req, "image")
        job = submit(engine, "image", params_of(req, req.n), "img")
        if req.stream:
            return StreamingResponse(_sse(engine, job, request, req),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": job.id})
        try:
            while True:
                try:
                    what, _ = await asyncio.wait_for(job.events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        engine.cancel(job.id)
                        raise APIError(499, "client disconnected", code="cancelled") from None
                    continue
                if what in ("done", "error", "cancelled"):
                    break
        except asyncio.CancelledError:
            engine.cancel(job.id)
            raise
        if job.status != "completed":
            raise job_error(job)
        payload = await asyncio.to_thread(image_payload, job, request, req)
        engine.forget(job.id)
        return JSONResponse(payload, headers={"X-Request-Id": job.id,
                                              "Server-Timing": server_timing(job)})

    async def _sse(engine: Engine, job: Job, request: Request, req: ImageGenerationRequest):
        finished = False
        try:
            yield _event("queued", {"type": "queued", "id": job.id})
            while True:
                what, payload = await job.events.get()
                if what == "progress":
                    yield _event("progress", {"type": "progress", "id": job.id, **payload})
                    continue
                finished = True
                if what == "done":
                    body = await asyncio.to_thread(image_payload, job, request, req)
                    engine.forget(job.id)
                    # OpenAI's completed event, one per image (its SDK reads these; omni adds
                    # id and index, and url in place of b64_json for response_format="url")
                    for index, item in enumerate(body["data"]):
                        yield _event("image_generation.completed", {
                            "type": "image_generation.completed", "id": job.id, "index": index,
                            "created_at": body["created"], "size": body["size"],
                            "output_format": body["output_format"], "background": "opaque",
                            "quality": None, "usage": None, **item})
                else:
                    err = job_error(job)
                    yield _event("error", error_body(err.message, err.type, err.param, err.code))
                yield "data: [DONE]\n\n"
                return
        finally:
            if not finished:  # the client went away
                engine.cancel(job.id)

    # ------------------------------------------------------------------ videos

    def video_object(engine: Engine, job: Job) -> dict:
        """OpenAI's Video object (``seconds``: the time the clip spans, once its length is
        known: :func:`omni_serve.schemas.seconds_of`)."""
        completed = job.status == "completed"
        frames = len(job.result["frames"]) if completed else job.params.get("num_frames")
        obj = {"id": job.id, "object": "video", "model": name_of(engine), "status": job.status,
               "progress": round(job.progress * 100), "created_at": int(job.created),
               "completed_at": int(job.finished) if completed else None,
               "expires_at": int(job.finished + engine.keep_videos_s) if completed else None,
               "size": size_of(job),
               "seconds": seconds_of(frames) if frames else None,
               "prompt": job.params["prompt"]}
        if job.status == "failed":
            etype, message = job.error or ("server_error", "unknown error")
            obj["error"] = {"code": "generation_failed", "message": message, "type": etype}
        return obj

    def video_job(video_id: str) -> tuple[Engine, Job]:
        for engine in engines:
            job = engine.jobs.get(video_id)
            if job is not None and job.kind == "video":
                return engine, job
        raise APIError(404, f"no video {video_id!r}", param="video_id", code="not_found")

    async def video_request(request: Request) -> VideoCreateRequest:
        """The create body as JSON, or as form fields (OpenAI's SDK posts multipart/form-data;
        form values are strings, so they are validated in pydantic's lax mode)."""
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
            try:
                form = await request.form(max_files=1, max_fields=32)
            except (MultiPartException, StarletteHTTPException, UnicodeDecodeError,
                    ValueError) as exc:
                raise APIError(400, f"the body is not valid {content_type}: {exc}",
                               code="invalid_value") from None
            fields: Any = {}
            try:
                for key, value in form.multi_items():
                    if key in fields:
                        raise APIError(400, f"{key}: given more than once", param=key,
                                       code="invalid_value")
                    if not isinstance(value, str) and key != "input_reference":
                        raise APIError(400, f"{key}: must be a text field, not a file",
                                       param=key, code="invalid_value")
                    fields[key] = value
            finally:
                await form.close()
            strict = False
        elif content_type in ("", "application/json") or content_type.endswith("+json"):
            try:
                fields = json.loads(await request.body())
            except (ValueError, RecursionError):
                raise RequestValidationError([{"type": "json_invalid", "loc": ("body",),
                                               "msg": "invalid JSON"}]) from None
            strict = True
        else:
            raise APIError(415, f"Content-Type {content_type!r} is not accepted: send "
                                "application/json or multipart/form-data",
                           code="unsupported_media_type")
        if isinstance(fields, dict) and "input_reference" in fields:
            raise APIError(400, "input_reference: image-to-video is not supported; this server "
                                "generates a video from the prompt alone",
                           param="input_reference", code="unsupported_value")
        try:
            return VideoCreateRequest.model_validate(fields, strict=strict)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(include_url=False)) from None

    video_body = VideoCreateRequest.model_json_schema()

    @app.post("/v1/videos", dependencies=[Depends(authorize)], openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": video_body},
                                      "multipart/form-data": {"schema": video_body}}}})
    async def create_video(request: Request):
        req = await video_request(request)
        engine = check_model(req, "video")
        job = submit(engine, "video", params_of(req), "video")
        return video_object(engine, job)

    @app.get("/v1/videos", dependencies=[Depends(authorize)])
    async def list_videos(
        after: str | None = Query(None, max_length=128,
                                  description="the id of the last video of the previous page"),
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = Query("desc", description="by creation time"),
    ):
        jobs = sorted(((j.created, j.id, e, j) for e in engines for j in list(e.jobs.values())
                       if j.kind == "video"), key=lambda item: item[:2],
                      reverse=order == "desc")
        start = 0
        if after is not None:
            ids = [item[1] for item in jobs]
            if after not in ids:
                raise APIError(400, f"after: no video {after!r} (deleted, expired or never "
                                    "made)", param="after", code="invalid_value")
            start = ids.index(after) + 1
        page = [video_object(e, j) for _, _, e, j in jobs[start:start + limit]]
        return {"object": "list", "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": start + limit < len(jobs)}

    @app.get("/v1/videos/{video_id}", dependencies=[Depends(authorize)])
    async def get_video(video_id: str):
        return video_object(*video_job(video_id))

    @app.get("/v1/videos/{video_id}/content", dependencies=[Depends(authorize)])
    async def get_video_content(
        video_id: str,
        format: Literal["mp4", "apng", "frames"] = Query(
            "mp4", description="mp4 (H.264, video/mp4), apng (animated PNG) or frames "
                               "(JSON: each frame a base64 PNG)"),
        variant: Literal["video", "thumbnail", "spritesheet"] = Query(
            "video", description="video; thumbnail (the first frame as a PNG); or spritesheet "
                                 "(every frame in one PNG grid)"),
    ):
        _, job = video_job(video_id)
        if job.status != "completed":
            raise APIError(409, f"video {video_id!r} is {job.status}, not completed",
                           param="video_id", code="not_ready")
        frames = job.result["frames"]
        if variant == "thumbnail":
            return Response(frames[0], media_type="image/png")
        if variant == "spritesheet":
            return Response(await asyncio.to_thread(encode_spritesheet, frames),
                            media_type="image/png")
        if format == "frames":
            return {"object": "video.frames", "id": job.id, "fps": FPS,
                    "frames": [base64.b64encode(f).decode() for f in frames]}
        encoded = job.result.setdefault("encoded", {})
        if format not in encoded:  # encode once; later fetches reuse it
            encode = encode_mp4 if format == "mp4" else encode_apng
            encoded[format] = await asyncio.to_thread(encode, frames)
        return Response(encoded[format],
                        media_type="video/mp4" if format == "mp4" else "image/apng")

    @app.delete("/v1/videos/{video_id}", dependencies=[Depends(authorize)])
    async def delete_video(video_id: str):
        engine, job = video_job(video_id)
        engine.cancel(job.id)
        engine.forget(job.id)
        return {"id": job.id, "object": "video.deleted", "deleted": True}

    return app


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"
