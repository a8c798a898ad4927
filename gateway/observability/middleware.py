"""Per-request telemetry as a plain ASGI middleware: request id, log context, request metrics.

A plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``) so that streamed responses
pass through untouched and the duration covers the last body byte. It sits inside the
OpenTelemetry middleware, so the HTTP server span is current and its trace id can be bound
into the log context.
"""

from __future__ import annotations

import re
import time
import uuid

import structlog
from opentelemetry import trace
from opentelemetry.trace import format_span_id, format_trace_id
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.observability.metrics import Metrics

REQUEST_ID_HEADER = "x-request-id"
UNMATCHED_ROUTE = "unmatched"
# A client's own request id is reused only if it is short and plain, since it reaches logs.
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

_log = structlog.get_logger("specgate.http")


def request_id_from(scope: Scope) -> str:
    """The client's ``x-request-id`` if it is plain enough to log, else a fresh one."""
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            if _CLIENT_REQUEST_ID.match(text):
                return text
    return uuid.uuid4().hex


def route_template(scope: Scope) -> str:
    """The matched route's path template (``/v1/chat/completions``), never the raw path."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED_ROUTE


class RequestTelemetryMiddleware:
    """Binds request id and trace id to every log line of a request and counts the request.

    The request id is exposed to routes as ``request.state.request_id`` and returned in
    the ``x-request-id`` response header.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        log_context: dict[str, str] = {"request_id": request_id}
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            log_context["trace_id"] = format_trace_id(span_context.trace_id)
            log_context["span_id"] = format_span_id(span_context.span_id)
        status = 500
        header = (REQUEST_ID_HEADER.encode(), request_id.encode())

        async def send_with_request_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        started = time.perf_counter()
        with structlog.contextvars.bound_contextvars(**log_context):
            try:
                await self.app(scope, receive, send_with_request_id)
            finally:
                duration = time.perf_counter() - started
                route = route_template(scope)
                self.metrics.observe_request(route, status, duration)
                _log.info(
                    "request finished",
                    http_method=scope.get("method"),
                    route=route,
                    status=status,
                    duration_ms=round(duration * 1000, 3),
                )
