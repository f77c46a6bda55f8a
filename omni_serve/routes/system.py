"""``/health``, ``/health/ready``, ``/metrics``, ``/`` (the playground) and ``/v1/models``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from omni_serve.metrics import CONTENT_TYPE_LATEST
from omni_serve.middleware import has_api_key, require_api_key
from omni_serve.playground import PAGE
from omni_serve.state import ServerState, server_state

router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/health/ready")
async def ready(request: Request, server: ServerState = Depends(server_state)):
    """Readiness (503 until every worker is ready); the workers' details only with the API key."""
    engines = server.engines
    ok = all(e.ready for e in engines)
    if not has_api_key(request):
        return JSONResponse({"status": "ready" if ok else "not_ready"},
                            status_code=200 if ok else 503)
    workers = [{"model": server.name_of(e), "kind": e.kind, "ready": e.ready,
                "queue_depth": e.queue_depth, "worker_pid": e.worker_pid,
                "worker_pids": e.worker_pids, "replicas": e.replica_status,
                "max_batch": e.max_batch, "error": e.fatal}
               for e in engines]
    body = {"status": "ready" if ok else "not_ready", "workers": workers,
            "queue_depth": sum(e.queue_depth for e in engines),
            "worker_pid": engines[0].worker_pid}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics_endpoint(server: ServerState = Depends(server_state)):
    server.metrics.queue_depth.set(sum(e.queue_depth for e in server.engines))
    return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/", response_class=HTMLResponse)
async def playground():
    return HTMLResponse(PAGE)


def _model_card(server: ServerState, engine) -> dict:
    """OpenAI's Model object (id, object, created, owned_by) and omni's kind and pipeline."""
    return {"id": server.name_of(engine), "object": "model", "created": 0, "owned_by": "omni",
            "kind": engine.kind, "pipeline": (engine.info or {}).get("pipeline")}


@router.get("/v1/models", dependencies=[Depends(require_api_key)])
async def models(server: ServerState = Depends(server_state)):
    return {"object": "list", "data": [_model_card(server, e) for e in server.engines]}


@router.get("/v1/models/{model_id:path}", dependencies=[Depends(require_api_key)])
async def model(model_id: str, server: ServerState = Depends(server_state)):
    """One model as ``/v1/models`` lists it (the SDK's ``models.retrieve``); 404 when not served."""
    return _model_card(server, server.engine_named(model_id, status=404))
