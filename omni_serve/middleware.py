"""What runs around every route: the API key check, the request-body limit, request metrics."""

from __future__ import annotations

import hmac
import time

from fastapi import Request

from omni_serve.errors import APIError
from omni_serve.state import server_state


def require_api_key(request: Request) -> None:
    """The dependency guarding ``/v1/*``: ``Authorization: Bearer <key>`` when the server has one."""
    api_key = server_state(request).api_key
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else ""
    if not hmac.compare_digest(given.encode(), api_key.encode()):
        raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class ObserveRequests:
    """Pure ASGI middleware: body-size limit, request counts by outcome, latency."""

    def __init__(self, app, metrics, max_body: int) -> None:
        self.app, self.metrics, self.max_body = app, metrics, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = {"code": 500}
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        too_big = False
        if length is not None:
            try:
                too_big = int(length) > self.max_body
            except ValueError:
                too_big = True
        if too_big:
            response = APIError(413, f"request body larger than {self.max_body} bytes",
                                code="body_too_large").response()
            status["code"] = 413
            await response(scope, receive, send)
        else:
            received = {"n": 0}

            async def limited_receive():
                message = await receive()
                if message["type"] == "http.request":
                    received["n"] += len(message.get("body", b""))
                    if received["n"] > self.max_body:
                        raise APIError(413, f"request body larger than {self.max_body} bytes",
                                       code="body_too_large")
                return message

            async def observed_send(message):
                if message["type"] == "http.response.start":
                    status["code"] = message["status"]
                await send(message)

            try:
                await self.app(scope, limited_receive, observed_send)
            except APIError as exc:
                status["code"] = exc.status
                await exc.response()(scope, receive, send)
        route = scope.get("route")
        endpoint = getattr(route, "path", None) or "other"
        code = status["code"]
        outcome = ("success" if code < 400 else "rejected" if code == 429
                   else "cancelled" if code == 499 else "client_error" if code < 500
                   else "server_error")
        self.metrics.requests.labels(endpoint, outcome).inc()
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
