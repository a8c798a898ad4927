"""Refuse request bodies over the configured size with a 413 in OpenAI's error shape.

Starlette's own ``RequestBodyLimitMiddleware`` answers a too-large ``Content-Length`` with a
plain-text body, which OpenAI clients cannot parse; this one answers every case in JSON and
checks both the declared length and the bytes actually received (chunked uploads).
"""

from __future__ import annotations

import asyncio

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


class _TooSlow(HTTPException):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(status_code=408, detail=_slow_message(timeout_s))


def _slow_message(timeout_s: float) -> str:
    return f"The request body did not arrive within {timeout_s:g} s."


class BodySizeLimitMiddleware:
    """Also bounds the time the whole body may take (``body_timeout_s``, from when the app
    first reads it, right after the headers): a client that stops sending mid-body, or
    trickles it a byte at a time, is answered 408 instead of holding the request open. A
    bound on each read alone would let a byte per read keep a request open for ever."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

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
        body_done = False
        timeout_s = self.body_timeout_s
        deadline: float | None = None

        async def limited_receive() -> Message:
            nonlocal received, body_done, deadline
            if body_done:  # later receives wait for the disconnect: no bound on those
                return await receive()
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + timeout_s
            try:
                # A timeout scope, not ``wait_for``: on Python 3.11 that wraps the receive in
                # a task of its own, one more turn of the event loop per body message.
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _TooSlow(timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
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
        except _TooSlow:
            if started:
                raise
            slow = APIError(408, _slow_message(timeout_s), code="request_timeout")
            await error_response(slow)(scope, receive, send)
