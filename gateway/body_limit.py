"""Refuse request bodies over the configured size with a 413 in OpenAI's error shape.

Starlette's own ``RequestBodyLimitMiddleware`` answers a too-large ``Content-Length`` with a
plain-text body, which OpenAI clients cannot parse; this one answers every case in JSON and
checks both the declared length and the bytes actually received (chunked uploads).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError, error_response


def _message(limit: int) -> str:
    return f"The request body is larger than the limit of {limit} bytes."


class _TooLarge(HTTPException):
    """An HTTPException so that FastAPI's body reader passes it on to the error handlers."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=_message(limit))


def _too_large(limit: int) -> APIError:
    return APIError(413, _message(limit), code="request_too_large")


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await error_response(_too_large(limit))(scope, receive, send)
                return

        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _TooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if started:
                raise
            await error_response(_too_large(limit))(scope, receive, send)
