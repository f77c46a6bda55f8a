"""OpenAI-style errors: :class:`APIError`, the body it answers with, and the app's handlers.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}``:
request validation failures become a 400 naming the offending field, Starlette's HTTP
errors keep their status, and engine errors map to the status a client can act on.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from omni_serve.engine import Job
from omni_serve.schemas import error_body


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status, headers=self.headers)


def _param_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or None


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


async def _http(request: Request, exc: StarletteHTTPException):
    return APIError(exc.status_code, str(exc.detail),
                    code="not_found" if exc.status_code == 404 else None,
                    headers=getattr(exc, "headers", None)).response()


async def _api(request: Request, exc: APIError):
    return exc.response()


def add_exception_handlers(app: FastAPI) -> None:
    """Answer validation, HTTP and :class:`APIError` exceptions with OpenAI-style bodies."""
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(APIError, _api)


def job_error(job: Job) -> APIError:
    """The error a client gets for a job that did not complete."""
    if job.status == "cancelled":
        return APIError(499, "the request was cancelled", code="cancelled")
    etype, message = job.error or ("server_error", "unknown error")
    status = 400 if etype == "invalid_request_error" else 500
    return APIError(status, message, type=etype, code="generation_failed")
