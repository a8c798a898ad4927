"""Every error leaves the gateway in OpenAI's shape: ``{"error": {message, type, param, code}}``.

Clients written against OpenAI read ``error.message`` and ``error.param``; keeping that shape
for validation errors, unknown routes, oversized bodies and server faults alike means they
never have to special-case Specgate. Bad input is always a 4xx, never a 500.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.api.types import (
    BackendUnavailableError,
    EngineClosedError,
    InvalidRequestError,
    MethodUnavailableError,
    NoChatTemplateError,
    PromptTooLongError,
    QueueFullError,
)
from gateway.audit.log import AuditUnavailableError

log = structlog.get_logger(__name__)


class APIError(Exception):
    """An error answered to the client as it stands; routes raise it, the handler renders it."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


class RefusedBody(StarletteHTTPException):
    """A request body refused while it is read, carrying its answer. An HTTPException,
    because FastAPI turns any other error in its body reading into a bare 400."""

    def __init__(self, error: APIError) -> None:
        super().__init__(status_code=error.status_code, detail=error.message)
        self.error = error


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(error.message, error.type, error.param, error.code),
        status_code=error.status_code,
        headers=error.headers,
    )


def audit_unavailable() -> APIError:
    return APIError(
        503,
        "The audit log is unavailable, so the request was not served. Retry later.",
        type="service_unavailable",
        code="audit_unavailable",
    )


# Seconds a client is asked to wait after a 429 (the ``Retry-After`` header).
RETRY_AFTER_S = 1


def queue_full() -> APIError:
    return APIError(
        429,
        "The server's request queue is full. Retry later.",
        type="rate_limit_error",
        code="queue_full",
        headers={"retry-after": str(RETRY_AFTER_S)},
    )


def completion_not_recorded() -> APIError:
    """The output was generated but neither the audit store nor the local spool could record
    its `completion` event: the client must not treat it as audited."""
    return APIError(
        503,
        "The completion could not be recorded: the audit log is unavailable and the local "
        "audit spool could not be written. Treat this output as unaudited and retry later.",
        type="service_unavailable",
        code="completion_not_recorded",
    )


def shutting_down(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="shutting_down")


def from_engine_error(error: Exception) -> APIError:
    """Map the engine's deliberate errors to HTTP; anything else is not the client's fault."""
    if isinstance(error, PromptTooLongError):
        return APIError(
            400, str(error), param=error.param or "messages", code="context_length_exceeded"
        )
    if isinstance(error, MethodUnavailableError):
        return APIError(
            400, str(error), param=error.param or "speculative.method", code="method_unavailable"
        )
    if isinstance(error, NoChatTemplateError):
        return APIError(400, str(error), param=error.param, code="chat_template_missing")
    if isinstance(error, InvalidRequestError):
        return APIError(400, str(error), param=error.param)
    if isinstance(error, QueueFullError):
        return queue_full()
    if isinstance(error, BackendUnavailableError):
        return APIError(503, str(error), type="service_unavailable", code="backend_unavailable")
    if isinstance(error, EngineClosedError):
        return APIError(
            503, "The engine is shutting down.", type="service_unavailable", code="engine_closed"
        )
    return APIError(
        500, "The server had an error while processing the request.", type="server_error"
    )


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _is_union_tag(part: str) -> bool:
    """Pydantic names the union member that failed (``bool``, ``list[int]``, a model class) in
    the location; field names are snake_case, so the tags are easy to tell apart."""
    return part in _TYPE_TAGS or "[" in part or part[:1].isupper()


def param_from_loc(loc: Sequence[int | str]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"`` (location kind dropped)."""
    parts = list(loc[1:]) if loc and loc[0] in ("body", "query", "path", "header") else list(loc)
    text = ""
    for part in parts:
        if isinstance(part, str) and _is_union_tag(part):
            continue
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or None


def _validation_message(item: dict[str, Any], param: str | None) -> str:
    kind = item.get("type")
    if kind == "json_invalid":
        reason = item.get("ctx", {}).get("error", "invalid JSON")
        return f"The request body is not valid JSON: {reason}."
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}"
    if kind == "missing":
        return f"Missing required parameter: '{param}'." if param else "A request body is required."
    msg = str(item.get("msg", "invalid value"))
    return f"Invalid value for '{param}': {msg}" if param else msg


async def _handle_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    # Of a field's errors (one per union member), the deepest location says the most.
    field = errors[0].get("loc", ())[:2]
    first = max(
        (item for item in errors if item.get("loc", ())[:2] == field),
        key=lambda item: len(item.get("loc", ())),
    )
    loc = first.get("loc", ())
    if first.get("type") == "union_tag_invalid":  # name the tag field itself (`...type`)
        loc = (*loc, str(first.get("ctx", {}).get("discriminator", "")).strip("'"))
    param = None if first.get("type") == "json_invalid" else param_from_loc(loc)
    return error_response(APIError(400, _validation_message(first, param), param=param))


_HTTP_CODES = {
    400: ("invalid_request_error", "invalid_body"),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
}


async def _handle_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc, RefusedBody):
        return error_response(exc.error)
    kind, code = _HTTP_CODES.get(exc.status_code, ("invalid_request_error", None))
    if exc.status_code == 404:
        message = f"Unknown request URL: {request.method} {request.url.path}."
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}."
    elif exc.status_code == 400:
        message = "The request body could not be read: it must be UTF-8 encoded JSON."
    else:
        message = str(exc.detail)
    headers = dict(exc.headers) if exc.headers else None
    return error_response(APIError(exc.status_code, message, type=kind, code=code, headers=headers))


async def _handle_api(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _handle_audit_unavailable(request: Request, exc: Exception) -> JSONResponse:
    log.error("audit_unavailable", error=str(exc))
    return error_response(audit_unavailable())


async def _handle_engine(request: Request, exc: Exception) -> JSONResponse:
    return error_response(from_engine_error(exc))


async def _handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled_error", path=request.url.path)
    return error_response(from_engine_error(exc))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _handle_api)
    app.add_exception_handler(RequestValidationError, _handle_validation)
    app.add_exception_handler(StarletteHTTPException, _handle_http)
    app.add_exception_handler(AuditUnavailableError, _handle_audit_unavailable)
    # Each answered here, inside the telemetry middleware, so that metrics and the request
    # log see the status sent; the catch-all below runs outside it and sees an exception.
    for engine_error in (
        InvalidRequestError,
        QueueFullError,
        EngineClosedError,
        BackendUnavailableError,
    ):
        app.add_exception_handler(engine_error, _handle_engine)
    app.add_exception_handler(Exception, _handle_unexpected)
