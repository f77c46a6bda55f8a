"""``POST /v1/images/generations`` (plain or streamed as server-sent events) and
``GET /v1/files/{name}`` (the files behind ``response_format="url"``)."""

from __future__ import annotations

import asyncio
import base64
import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omni_serve.engine import TERMINAL, Engine, Job
from omni_serve.errors import APIError, job_error
from omni_serve.media import IMAGE_MEDIA_TYPES
from omni_serve.middleware import require_api_key, require_key_or_signature
from omni_serve.schemas import ImageGenerationRequest, error_body
from omni_serve.state import ServerState, server_state, size_of

router = APIRouter()


@router.get("/v1/files/{name}", dependencies=[Depends(require_key_or_signature)])
async def get_file(name: str, server: ServerState = Depends(server_state)):
    entry = server.files.get(name)
    if entry is None:
        raise APIError(404, "no such file (or it expired)", code="not_found")
    with open(entry[0], "rb") as f:
        return Response(f.read(), media_type=entry[1])


def image_payload(server: ServerState, job: Job, request: Request,
                  req: ImageGenerationRequest) -> dict:
    """OpenAI's images response: each image (encoded by the worker in req.output_format)
    inline or as a file."""
    data = []
    for image in job.result["images"]:
        if req.response_format == "url":
            name = server.files.put(image, req.output_format,
                                    IMAGE_MEDIA_TYPES[req.output_format])
            url = str(request.base_url) + f"v1/files/{name}"
            if server.api_key is not None:  # so a browser's <img> can load it without the key
                url += "?" + server.files.signed_query(name)
            data.append({"url": url})
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


@router.post("/v1/images/generations", dependencies=[Depends(require_api_key)])
async def images_generations(req: ImageGenerationRequest, request: Request,
                             server: ServerState = Depends(server_state)):
    engine, job = server.submit(req, "image", prefix="img", n=req.n)
    if req.stream:
        return StreamingResponse(_sse(server, engine, job, request, req),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": job.id})
    await _until_finished(engine, job, request)
    if job.status != "completed":
        raise job_error(job)
    payload = await asyncio.to_thread(image_payload, server, job, request, req)
    engine.forget(job.id)
    return JSONResponse(payload, headers={"X-Request-Id": job.id,
                                          "Server-Timing": server_timing(job)})


async def _until_finished(engine: Engine, job: Job, request: Request) -> None:
    """Wait for the job's terminal event; cancel it when the client goes away."""
    try:
        while True:
            try:
                what, _ = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.cancel(job.id)
                    raise APIError(499, "client disconnected", code="cancelled") from None
                continue
            if what in TERMINAL:
                return
    except asyncio.CancelledError:
        engine.cancel(job.id)
        raise


async def _sse(server: ServerState, engine: Engine, job: Job, request: Request,
               req: ImageGenerationRequest):
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
                body = await asyncio.to_thread(image_payload, server, job, request, req)
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


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"
