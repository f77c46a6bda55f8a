"""The FastAPI application: OpenAI-style image and video endpoints over an :class:`Engine`.

``create_app(engines, api_key=...)`` builds it over one :class:`Engine` or several (one
per kind: the embedded image and video models); the engines' workers start in the
app's lifespan (or are started by the caller when ``manage_engine=False``).
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI

from omni_serve.engine import Engine
from omni_serve.errors import add_exception_handlers
from omni_serve.files import FileStore
from omni_serve.middleware import ObserveRequests
from omni_serve.routes import images, system, videos
from omni_serve.schemas import MAX_BODY_BYTES, parse_size
from omni_serve.state import ServerState


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    server: ServerState = app.state.server
    if server.manage_engine:
        await asyncio.gather(*(engine.start() for engine in server.engines))
    try:
        yield
    finally:
        if server.manage_engine:
            await asyncio.gather(*(engine.stop() for engine in server.engines))
        server.files.close()


def create_app(engines: Engine | list[Engine], *, api_key: str | None = None, model_id: str = "omni",
               default_size: str = "1024x1024", file_ttl: float = 3600.0,
               manage_engine: bool = True) -> FastAPI:
    """The app serving ``engines`` (one :class:`Engine` or a list, at most one per kind).

    Args:
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <key>`` (401 otherwise),
            ``/v1/files/*`` the key or its url's signature, ``/health/ready`` the key for details.
        model_id: the id ``/v1/models`` lists and requests may name, for engines without
            their own ``name``.
        default_size: ``"WxH"`` used when a request gives no size.
        file_ttl: seconds a ``response_format="url"`` file (and its signed url) stays available.
        manage_engine: start and stop the engine in the app's lifespan.
    """
    parse_size(default_size)
    engines = [engines] if isinstance(engines, Engine) else list(engines)
    if not engines:
        raise ValueError("create_app needs at least one engine")
    for other in engines[1:]:
        other.metrics = engines[0].metrics
    server = ServerState(engines, FileStore(file_ttl), model_id=model_id,
                         default_size=default_size, api_key=api_key,
                         manage_engine=manage_engine)

    app = FastAPI(title="omni-serve", version="0.1.0", lifespan=_lifespan)
    app.state.server = server
    app.state.engines, app.state.files = server.engines, server.files
    app.add_middleware(ObserveRequests, metrics=server.metrics, max_body=MAX_BODY_BYTES)
    add_exception_handlers(app)
    for routes in (system, images, videos):
        app.include_router(routes.router)
    return app
