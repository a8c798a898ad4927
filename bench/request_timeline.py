"""Where one request's time goes: ``perf_counter`` stamps along the gateway's path.

``instrument(app, services, timeline)`` wraps, on the serving instances only (nothing in the
gateway is changed for it), each place a request crosses a thread or a stage: the ASGI entry
and the response's first and last send, the hand-off to the prepare pool and back, each audit
commit's start, its hand-off to the database pool and work there when it goes through the
pool, or, from the event loop, the statement handed to psycopg and the moment psycopg has
turned its parameters into bytes (when it leaves), its answer and the way back to the
request, the engine's first and
last delta and the wake-up of the loop that waits for them. The client adds its own send and
receive. Consecutive stamps cut a request into intervals that sum, by construction, to what the
client measured; each interval is charged to the stamp that ends it (``PIECES`` names what
happened in it). With the engine started while the `request` commit is in flight, the two run
side by side and the stamps interleave: the interval charged to the commit is then only the
part of it the engine did not hide.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import psycopg
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.api.types import GenerationResult, StreamDelta
from engine.serving.service import RequestHandle
from gateway.dependencies import Services

# Each stamp, and what the interval that ends at it holds (on the strict path, in order).
PIECES: dict[str, str] = {
    "app entered": "request over loopback HTTP, parsed, the loop woken",
    "prepare submitted": "middleware, body read and validation, key check, admission",
    "prepare started": "hand-off to the prepare pool",
    "prepare finished": "validation against the model, chat template, tokenize",
    "prepare returned": "hand-off back to the loop",
    "request commit submitted": "GenAI span, prompt commitment, `request` payload",
    "request commit started": "hand-off to the database pool (an append from the pool)",
    "request commit sent": "from the loop: the event built (chain, MAC), up to the statement",
    "request commit adapted": "from the loop: psycopg turning the parameters into bytes",
    "request commit finished": "`request` append and commit (from the loop: its round trip)",
    "request commit returned": "hand-off back to the awaiting request",
    "engine submitted": "on the loop before the engine",
    "engine first delta": "engine: queue, prefill, first token",
    "engine final delta": "engine: the other tokens",
    "engine returned": "hand-off from the engine's thread back to the loop",
    "completion commit submitted": "`completion` payload, metrics, span attributes",
    "completion commit started": "hand-off to the database pool (an append from the pool)",
    "completion commit sent": "from the loop: the event built, what runs before the statement",
    "completion commit adapted": "from the loop: psycopg turning the parameters into bytes",
    "completion commit finished": "`completion` append and commit (from the loop: its round trip)",
    "completion commit returned": "hand-off back to the awaiting request",
    "response started": "response built (pydantic, JSON), middleware",
    "response sent": "response body written",
    "client received": "response over loopback HTTP, read by the client",
}
ENGINE_STAMPS = ("engine first delta", "engine final delta")


class Timeline:
    """The stamps of the request in flight (one at a time: concurrency 1); stamps are taken
    only while ``enabled``."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []
        self.enabled = False
        self.loop = ""  # the serving event loop's class, seen on the first request

    def mark(self, name: str) -> None:
        self.mark_at(name, time.perf_counter())

    def mark_at(self, name: str, at: float) -> None:
        """A stamp taken elsewhere on the same clock (another process's ``perf_counter``)."""
        if self.enabled:
            self.marks.append((name, at))

    def take(self) -> list[tuple[str, float]]:
        marks, self.marks = self.marks, []
        return marks


def intervals(marks: list[tuple[str, float]]) -> dict[str, float]:
    """Seconds charged to each stamp: from the stamp before it (in time) to it."""
    ordered = sorted(marks, key=lambda mark: mark[1])
    charged: dict[str, float] = {}
    for (_, before), (name, at) in itertools.pairwise(ordered):
        charged[name] = charged.get(name, 0.0) + at - before
    return charged


def engine_span(marks: list[tuple[str, float]]) -> float:
    """Seconds from the engine's submit to its final delta (the direct call's comparison)."""
    at = dict(marks)
    return at["engine final delta"] - at["engine submitted"]


def stamp_handle(handle: RequestHandle, timeline: Timeline) -> RequestHandle:
    """Stamp the engine's first and final delta (on its worker thread, before the wake-up)."""
    put = handle.put
    first = True

    def stamped_put(item: StreamDelta | BaseException) -> None:
        nonlocal first
        if first:
            timeline.mark("engine first delta")
            first = False
        if isinstance(item, BaseException) or item.finish_reason is not None:
            timeline.mark("engine final delta")
        put(item)

    result_async = handle.result_async

    async def stamped_result() -> GenerationResult:
        result = await result_async()
        timeline.mark("engine returned")
        return result

    handle.put = stamped_put  # type: ignore[method-assign]
    handle.result_async = stamped_result  # type: ignore[method-assign]
    return handle


AUDITED = ("request", "completion")


def _db_call(fn: Callable[..., Any], args: tuple[Any, ...]) -> str:
    """``request commit`` / ``completion commit`` for the two audit appends, else the
    function's name (never its arguments: a key lookup's is the key)."""
    if args and args[0] in AUDITED:
        return f"{args[0]} commit"
    return str(getattr(fn, "__name__", "database call"))


def _stamped_call(fn: Callable[..., Any], timeline: Timeline, what: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        timeline.mark(f"{what} started")
        try:
            return fn(*args, **kwargs)
        finally:
            timeline.mark(f"{what} finished")

    return call


def stamped_app(app: ASGIApp, timeline: Timeline) -> ASGIApp:
    """``app`` with its entry and its response's first and last send stamped."""

    async def stamped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            timeline.mark("app entered")
            if not timeline.loop:
                loop = type(asyncio.get_running_loop())
                timeline.loop = f"{loop.__module__}.{loop.__qualname__}"

        async def stamped_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                timeline.mark("response started")
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                timeline.mark("response sent")

        await app(scope, receive, stamped_send)

    return stamped


def instrument(services: Services, timeline: Timeline) -> None:
    """Stamp the serving instances' request path (their methods are replaced for good).
    Background database work (lease renewal) that falls inside a request is stamped too, as
    ``<name> commit …``: it is on that request's path."""
    offload = services.offload
    prepare, submit_db, wait_db = offload.prepare, offload.submit_db, offload.wait_db

    async def stamped_prepare(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        timeline.mark("prepare submitted")
        try:
            return await prepare(_stamped_call(fn, timeline, "prepare"), *args, **kwargs)
        finally:
            timeline.mark("prepare returned")

    def stamped_submit_db(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        what = _db_call(fn, args)
        timeline.mark(f"{what} submitted")
        return submit_db(_stamped_call(fn, timeline, what), *args, **kwargs)

    async def stamped_wait_db(future: Future[Any], what: str) -> Any:
        try:
            return await wait_db(future, what)
        finally:
            kind = what.removesuffix(" append")
            timeline.mark(f"{kind} commit returned" if kind in AUDITED else f"{what} returned")

    appender = services.appender
    submit_append = appender.submit
    connected = appender._connected

    async def stamped_connected() -> Any:
        """The loop's connection, its statements stamped as they are handed to psycopg."""
        connection = await connected()
        if "execute" not in vars(connection):
            execute = connection.execute

            async def stamped_execute(query: Any, params: Any = None, **kwargs: Any) -> Any:
                if isinstance(params, dict) and params.get("kind"):
                    timeline.mark(f"{params['kind'][0]} commit sent")
                return await execute(query, params, **kwargs)

            connection.execute = stamped_execute  # type: ignore[method-assign]
        return connection

    # The parameters' conversion ends where the statement leaves: stamped on psycopg's cursor
    # class (this process only), for the two audit appends.
    convert = psycopg.AsyncCursor._convert_query

    def stamped_convert(cursor: Any, query: Any, params: Any = None) -> Any:
        converted = convert(cursor, query, params)
        if isinstance(params, dict) and params.get("kind"):
            timeline.mark(f"{params['kind'][0]} commit adapted")
        return converted

    psycopg.AsyncCursor._convert_query = stamped_convert  # type: ignore[method-assign]

    def stamped_submit_append(kind: str, actor: str | None, payload: dict[str, Any]) -> Any:
        what = f"{kind} commit"
        timeline.mark(f"{what} submitted")
        future = submit_append(kind, actor, payload)
        # From the loop, the statement's answer settles the future on the loop itself.
        future.add_done_callback(lambda _: timeline.mark(f"{what} finished"))
        return future

    backend = services.backend
    submit = backend.submit

    def stamped_submit(request: Any) -> Any:
        timeline.mark("engine submitted")
        handle = submit(request)
        assert isinstance(handle, RequestHandle), "stamping needs the built-in engine"
        return stamp_handle(handle, timeline)

    offload.prepare = stamped_prepare  # type: ignore[method-assign]
    offload.submit_db = stamped_submit_db  # type: ignore[method-assign]
    offload.wait_db = stamped_wait_db  # type: ignore[method-assign]
    appender.submit = stamped_submit_append  # type: ignore[method-assign]
    appender._connected = stamped_connected  # type: ignore[method-assign]
    backend.submit = stamped_submit  # type: ignore[method-assign]
