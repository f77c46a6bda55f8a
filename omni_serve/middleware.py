"""What runs around every route: the API key check, the request-body limit, request metrics."""

from __future__ import annotations

import hmac
import time

from fastapi import Request

from omni_serve.errors import APIError
from omni_serve.state import server_state


def has_api_key(request: Request) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <key>`` (True when no key is set)."""
    api_key = server_state(request).api_key
    if api_key is None:
        return True
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else ""
    return hmac.compare_digest(given.encode(), api_key.encode())


def require_api_key(request: Request) -> None:
    """The dependency guarding ``/v1/*``: ``Authorization: Bearer <key>`` when a key is set."""
    if not has_api_key(request):
        raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def require_key_or_signature(request: Request, name: str, expires: str | None = None,
                             signature: str | None = None) -> None:
    """The dependency guarding ``/v1/files/{name}``: the API key, or the signed, expiring
    query the server put in the ``url`` it returned (403 when tampered with or expired)."""
    if expires is None and signature is None or has_api_key(request):
        return require_api_key(request)
    if expires is None or signature is None:
        raise APIError(403, "a signed file URL needs both 'expires' and 'signature'",
                       param="signature", code="invalid_signature")
    problem = server_state(request).files.check_signature(name, expires, signature)
    if problem is not None:
        raise APIError(403, problem, param="signature", code="invalid_signature")


def _outcome(status: int) -> str:
    """The ``outcome`` label of a response status in the request metrics."""
    if status < 400:
        return "success"
    if status == 429:
        return "rejected"
    if status == 499:
        return "cancelled"
    return "client_error" if status < 500 else "server_error"


class ObserveRequests:
    """Pure ASGI middleware: body-size limit, request counts by outcome, latency."""

    def __init__(self, app, metrics, max_body: int) -> None:
        self.app, self.metrics, self.max_body = app, metrics, max_body

    def _too_large(self) -> APIError:
        return APIError(413, f"request body larger than {self.max_body} bytes",
                        code="body_too_large")

    def _declares_too_large(self, scope) -> bool:
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is None:
            return False
        try:
            return int(length) > self.max_body
        except ValueError:
            return True

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status, received = 500, 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise self._too_large()
            return message

        async def observed_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self._declares_too_large(scope):
                raise self._too_large()
            await self.app(scope, limited_receive, observed_send)
        except APIError as exc:
            status = exc.status
            await exc.response()(scope, receive, send)
        endpoint = getattr(scope.get("route"), "path", None) or "other"
        self.metrics.requests.labels(endpoint, _outcome(status)).inc()
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
