"""OpenAI's Videos API: ``POST /v1/videos`` (an asynchronous job), ``GET /v1/videos``
(paged), ``GET /v1/videos/{id}``, ``GET /v1/videos/{id}/content`` and ``DELETE``."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException

from omni_serve.engine import Engine, Job
from omni_serve.errors import APIError
from omni_serve.media import FPS, encode_apng, encode_mp4, encode_spritesheet
from omni_serve.middleware import require_api_key
from omni_serve.schemas import VideoCreateRequest, seconds_of
from omni_serve.state import ServerState, server_state, size_of

router = APIRouter(dependencies=[Depends(require_api_key)])


def video_object(server: ServerState, engine: Engine, job: Job) -> dict:
    """OpenAI's Video object (``seconds``: the time the clip spans, once its length is
    known: :func:`omni_serve.schemas.seconds_of`)."""
    completed = job.status == "completed"
    frames = len(job.result["frames"]) if completed else job.params.get("num_frames")
    obj = {"id": job.id, "object": "video", "model": server.name_of(engine), "status": job.status,
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


async def _form_fields(request: Request, content_type: str) -> dict[str, Any]:
    """The text fields of a form body, each given once (``input_reference`` may be a file,
    so that it is refused by name)."""
    try:
        form = await request.form(max_files=1, max_fields=32)
    except (MultiPartException, StarletteHTTPException, UnicodeDecodeError, ValueError) as exc:
        raise APIError(400, f"the body is not valid {content_type}: {exc}",
                       code="invalid_value") from None
    fields: dict[str, Any] = {}
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
    return fields


async def _json_fields(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, RecursionError):
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",),
                                       "msg": "invalid JSON"}]) from None


async def video_request(request: Request) -> VideoCreateRequest:
    """The create body as JSON, or as form fields (OpenAI's SDK posts multipart/form-data;
    form values are strings, so they are validated in pydantic's lax mode)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        fields, strict = await _form_fields(request, content_type), False
    elif content_type in ("", "application/json") or content_type.endswith("+json"):
        fields, strict = await _json_fields(request), True
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


_video_body = VideoCreateRequest.model_json_schema()


@router.post("/v1/videos", openapi_extra={"requestBody": {
    "required": True, "content": {"application/json": {"schema": _video_body},
                                  "multipart/form-data": {"schema": _video_body}}}})
async def create_video(request: Request, server: ServerState = Depends(server_state)):
    req = await video_request(request)
    engine, job = server.submit(req, "video", prefix="video")
    return video_object(server, engine, job)


@router.get("/v1/videos")
async def list_videos(
    after: str | None = Query(None, max_length=128,
                              description="the id of the last video of the previous page"),
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = Query("desc", description="by creation time"),
    server: ServerState = Depends(server_state),
):
    jobs = sorted(((j.created, j.id, e, j) for e in server.engines
                   for j in list(e.jobs.values()) if j.kind == "video"),
                  key=lambda item: item[:2], reverse=order == "desc")
    start = 0
    if after is not None:
        ids = [item[1] for item in jobs]
        if after not in ids:
            raise APIError(400, f"after: no video {after!r} (deleted, expired or never "
                                "made)", param="after", code="invalid_value")
        start = ids.index(after) + 1
    page = [video_object(server, e, j) for _, _, e, j in jobs[start:start + limit]]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + limit < len(jobs)}


@router.get("/v1/videos/{video_id}")
async def get_video(video_id: str, server: ServerState = Depends(server_state)):
    return video_object(server, *server.video_job(video_id))


@router.get("/v1/videos/{video_id}/content")
async def get_video_content(
    video_id: str,
    format: Literal["mp4", "apng", "frames"] = Query(
        "mp4", description="mp4 (H.264, video/mp4), apng (animated PNG) or frames "
                           "(JSON: each frame a base64 PNG)"),
    variant: Literal["video", "thumbnail", "spritesheet"] = Query(
        "video", description="video; thumbnail (the first frame as a PNG); or spritesheet "
                             "(every frame in one PNG grid)"),
    server: ServerState = Depends(server_state),
):
    _, job = server.video_job(video_id)
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


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, server: ServerState = Depends(server_state)):
    engine, job = server.video_job(video_id)
    engine.cancel(job.id)
    engine.forget(job.id)
    return {"id": job.id, "object": "video.deleted", "deleted": True}
