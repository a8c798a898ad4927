"""OpenAI's rate-limit headers (``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``) on
every response to a request that a quota applies to: 200s, streams, 429s and the errors
raised after admission alike.

The quota check publishes the headers for the request it runs in (``publish``); this
middleware, outside the error handlers, adds them to the response's start, whatever sends
it. A key without limits gets none; a kind of limit that does not apply (no request limit,
only a token budget) leaves its three headers out.
"""

from __future__ import annotations

from contextvars import ContextVar

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.quota_windows import Figure, Verdict

_published: ContextVar[dict[str, str] | None] = ContextVar("rate_limit_headers", default=None)


def duration(seconds: int) -> str:
    """``reset`` as OpenAI writes it: ``59s``, ``1m0s``, ``11h57m30s``."""
    hours, rest = divmod(max(0, seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def headers_for(verdict: Verdict) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind, figure in (("requests", verdict.requests), ("tokens", verdict.tokens)):
        if figure is not None:
            headers.update(_three(kind, figure))
    return headers


def _three(kind: str, figure: Figure) -> dict[str, str]:
    return {
        f"x-ratelimit-limit-{kind}": str(figure.limit),
        f"x-ratelimit-remaining-{kind}": str(figure.remaining),
        f"x-ratelimit-reset-{kind}": duration(figure.reset_s),
    }


def publish(headers: dict[str, str]) -> None:
    """Give the current request's response ``headers`` (no-op outside a request)."""
    holder = _published.get()
    if holder is not None:
        holder.update(headers)


class RateLimitHeaders:
    """Pure ASGI (no task of its own: a stream's chunks pass straight through)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        holder: dict[str, str] = {}
        token = _published.set(holder)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start" and holder:
                headers = MutableHeaders(scope=message)
                for name, value in holder.items():
                    headers[name] = value
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            _published.reset(token)
