"""Serving the app with uvicorn under Specgate's bounds.

- The port is bound before the app starts, so a start that cannot listen fails before it
  writes a `startup` event.
- HTTP/1.1 is parsed by httptools; a response's head and body leave in one write. A
  request's headers must arrive within ``header_timeout_s`` (uvicorn bounds only idle
  keep-alive connections); idle keep-alive connections close after ``keep_alive_timeout_s``;
  more than ``max_connections`` open connections are answered 503.
- SIGTERM starts the grace period (``gateway.lifecycle``): no new connections, running
  generations may finish for most of ``shutdown_grace_s``, and no database wait outlasts it.
  Kept-alive connections stay open meanwhile: a request on one is answered (the API: 503
  ``shutting_down``) with ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import functools
import math
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.dependencies import Services
from gateway.lifecycle import generations_s
from gateway.settings import Settings


class _OneWritePerTurn(asyncio.Transport):
    """A response's view of its connection: what it writes in one turn of the event loop
    leaves in one ``write``. uvicorn writes the status line and headers, then the body: two
    sends, two segments, and a client that may wake twice for a small answer. Held writes go
    out when the response is complete (``flush``), when the connection is closed, or at the
    loop's next turn (a stream's head and chunks wait at most that long)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(bytes(data))

    def flush(self) -> None:
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (C parsing, cheaper per request than h11's pure-Python
    parser) with a bound on the wait for a request's headers, against slow-header clients:
    the clock runs from the connection's start, and again from each response's end, until the
    next request's headers are complete.

    At shutdown an idle kept-alive connection is not closed at once, as uvicorn would: its
    client may be sending a request already, which would then meet a closed connection and
    get no answer at all. It stays open, for ``keep_alive_timeout_s`` of idleness as before
    and at most ``drain_s``; each request on it is served (the API answers 503
    ``shutting_down``) with ``Connection: close``."""

    def __init__(self, *args: Any, header_timeout_s: float, drain_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.drain_s = drain_s
        self._header_timer: asyncio.TimerHandle | None = None
        self._draining = False
        self._drain_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.transport is self.transport:
            cycle.transport = _OneWritePerTurn(self.transport, self.loop)
        if cycle is not None and self._draining:
            cycle.keep_alive = False

    def on_response_complete(self) -> None:
        held = self.cycle.transport if self.cycle is not None else None
        if isinstance(held, _OneWritePerTurn):
            held.flush()  # the head and the body: one write
        pipelined = bool(self.pipeline)  # the next request's headers are in already
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """Called by the server at SIGTERM: the response in progress, or else the next
        request's, is the connection's last; an idle connection is closed after ``drain_s``
        unless a request has come meanwhile."""
        self._draining = True
        if self._idle():
            self._drain_timer = self.loop.call_later(self.drain_s, self._close_if_idle)
        else:
            super().shutdown()

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _close_if_idle(self) -> None:
        self._drain_timer = None
        if self._idle() and not self.transport.is_closing():
            self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


class GracefulServer(uvicorn.Server):
    """uvicorn's server, starting the app's grace period when it is told to stop."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        services = getattr(self.app.state, "services", None)
        if services is not None:
            _begin_shutdown(services)
        await super().shutdown(sockets)


def _begin_shutdown(services: Services) -> None:
    """Start the grace period; from now on no database wait outlasts it."""
    services.offload.give_up_by(services.lifecycle.begin_shutdown())


def uvicorn_config(app: FastAPI, settings: Settings, **extra: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        http=functools.partial(  # type: ignore[arg-type]
            HeaderTimeoutProtocol,
            header_timeout_s=settings.header_timeout_s,
            drain_s=generations_s(settings.shutdown_grace_s, settings.audit_timeout_s),
        ),
        timeout_keep_alive=settings.keep_alive_timeout_s,
        limit_concurrency=settings.max_connections,
        # Every wait of a request ends with the grace: what is still running then is cancelled.
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s),
        **extra,
    )


def bind(settings: Settings) -> socket.socket:
    """The listening socket; raises OSError (port in use, no permission) before any start."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        listener.bind((settings.host, settings.port))
    except OSError:
        listener.close()
        raise
    listener.set_inheritable(True)
    return listener
