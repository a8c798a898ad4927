"""Appending at the known head from the event loop, without a thread hand-off (PostgreSQL).

An append through the database pool costs four wake-ups: the loop wakes a pool thread, the
thread wakes the database backend, the backend's answer wakes the thread, the thread wakes
the loop. On a busy machine each wake-up is a wait for a core, and they cost more than the
statement. When this process knows the head (``gateway.audit.known_head``) and none of its
appends is in progress, ``LoopAppender`` sends that one statement from the event loop on an
asynchronous psycopg connection of its own: two wake-ups. The statement is the same, and so
is what it guarantees: autocommitted, durable when it returns, nothing written unless the head
row is exactly the known one.

Everything else goes to the database pool through ``AuditLog.append``, as before: SQLite, an
unknown or moved head, another append in progress (it queues behind this one, as behind any
writer), a connection that cannot be opened, and a connection that ended under the statement
(then the pool first looks the event up: committed, or not written at all). Any other error
fails the append, as the pool's would: the statement may have committed.

The caller gets a ``concurrent.futures.Future`` either way, so waiting for it, its bound
(``gateway.offload``), the late-commit handling and the spool's backing of a direct attempt
are the same whichever way the event went. The statement runs in a task of its own: a caller
that gives up waiting (a stalled server) or is cancelled leaves it running, as a pool thread
would be left blocked.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import psycopg
import sqlalchemy as sa
import structlog

from gateway.audit.canonical import normalise_payload
from gateway.audit.known_head import APPEND, KnownHead, append_params
from gateway.audit.log import (
    AppendedEvent,
    AuditLog,
    AuditUnavailableError,
    BuiltEvents,
    build_events,
    checked_event,
)
from gateway.audit.merkle import CompactRange
from gateway.db import has_input

log = structlog.get_logger(__name__)

ToPool = Callable[..., "Future[AppendedEvent]"]


@dataclass
class _Attempt:
    """One append from the loop: the head it is written after, the tree and the events built
    after it, the event as given, and the caller's future."""

    known: KnownHead
    frontier: CompactRange
    built: BuiltEvents
    event: tuple[str, str | None, dict[str, Any]]
    result: Future[AppendedEvent]


class _HandedOn(Exception):
    """The append's result is settled on the pool (``LoopAppender._chain``)."""


def libpq_conninfo(db: sa.Engine) -> str:
    """The libpq URI of ``db``'s database (password included)."""
    return db.url.set(drivername="postgresql").render_as_string(hide_password=False)


class LoopAppender:
    """``submit`` appends one event, from the event loop when it can (see the module)."""

    def __init__(
        self,
        audit: AuditLog,
        to_pool: ToPool,
        conninfo: str | None,
        connect_args: dict[str, Any],
        lock_timeout_s: float,
    ) -> None:
        """``to_pool(fn, *args)`` runs ``fn(*args)`` on the database pool; ``conninfo`` is
        None where the loop path is not used (SQLite); ``connect_args`` are libpq's
        (timeouts)."""
        self._audit = audit
        self._to_pool = to_pool
        self._conninfo = conninfo
        self._connect_args = connect_args
        self._lock_timeout_s = lock_timeout_s
        self._connection: psycopg.AsyncConnection[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(
        self, kind: str, actor: str | None, payload: dict[str, Any]
    ) -> Future[AppendedEvent]:
        """Start appending one event (called on the event loop); the future holds what
        ``AuditLog.append`` would return or raise."""
        audit = self._audit
        loop = asyncio.get_running_loop()
        if self._conninfo is None or self._loop not in (None, loop):
            return self._to_pool(audit.append, kind, actor, payload)
        try:
            event = (*checked_event(kind, actor), normalise_payload(payload))
        except ValueError as error:
            refused: Future[AppendedEvent] = Future()
            refused.set_exception(error)
            return refused
        known = audit.claim_known_head()
        if known is None:
            return self._to_pool(audit.append, kind, actor, payload)
        self._loop = loop
        result: Future[AppendedEvent] = Future()
        frontier = known.frontier()
        try:
            built = build_events([event], known.head_hash, frontier, audit.mac)
        except BaseException:
            audit.release_writer(known)
            raise
        task = loop.create_task(self._append(_Attempt(known, frontier, built, event, result)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return result

    async def _append(self, attempt: _Attempt) -> None:
        """Settle the caller's future with the append, observed (span, timing) as one,
        whichever way it went."""
        try:
            with self._audit.observed(attempt.event[0]) as record:
                appended = await self._write(attempt)
                record(appended)
        except _HandedOn:
            return
        except Exception as error:
            attempt.result.set_exception(error)
            return
        attempt.result.set_result(appended)

    async def _write(self, attempt: _Attempt) -> AppendedEvent:
        audit = self._audit
        known, frontier, built = attempt.known, attempt.frontier, attempt.built
        event = attempt.event
        try:
            connection = await self._connected()
        except (psycopg.Error, OSError) as error:  # nothing was sent: the head is still known
            audit.release_writer(known)
            log.warning("loop_append_unconnected", error=str(error))
            return await self._in_pool(audit.append_unobserved, *event)
        except asyncio.CancelledError:
            audit.release_writer(known)
            self._chain(attempt.result, audit.append_unobserved, *event)
            raise _HandedOn from None
        params = append_params(
            known, frontier, built.head_hash, built.rows, built.nodes, self._lock_timeout_s
        )
        try:
            cursor = await connection.execute(APPEND, params)
            row = await cursor.fetchone()
        except psycopg.Error as error:
            audit.release_writer(None)
            if not connection.broken:
                raise AuditUnavailableError(f"audit store unavailable: {error}") from error
            self._drop(connection)
            return await self._in_pool(self._settle, attempt)
        except asyncio.CancelledError:
            # Stopped (``close``) with the statement in flight: its fate is read back on the
            # pool, not waited for here, and the connection is not used again.
            audit.release_writer(None)
            self._drop(connection)
            self._chain(attempt.result, self._settle, attempt)
            raise _HandedOn from None
        if not (row and row[0]):  # another writer moved the head: nothing was written
            audit.release_writer(None)
            return await self._in_pool(audit.append_unobserved, *event)
        audit.release_writer(KnownHead.after(frontier, built.head_hash), committed=True)
        return built.appended[0]

    def _settle(self, attempt: _Attempt) -> AppendedEvent:
        """After a connection ended under the statement (on the pool): the event if it was
        committed, else appended now."""
        appended = attempt.built.appended[0]
        if self._audit.written(appended.event_id):
            self._audit.remember_appended(attempt.frontier, attempt.built.head_hash)
            return appended
        return self._audit.append_unobserved(*attempt.event)

    async def _in_pool(self, fn: Callable[..., AppendedEvent], *args: Any) -> AppendedEvent:
        try:
            pooled = self._to_pool(fn, *args)
        except RuntimeError as error:  # the pool is shut down
            raise AuditUnavailableError(f"audit store unavailable: {error}") from error
        return await asyncio.wrap_future(pooled)

    def _chain(self, result: Future[AppendedEvent], fn: Callable[..., Any], *args: Any) -> None:
        """Settle ``result`` with ``fn(*args)`` run on the database pool, not waiting."""
        try:
            pooled = self._to_pool(fn, *args)
        except RuntimeError as error:  # the pool is shut down
            result.set_exception(AuditUnavailableError(f"audit store unavailable: {error}"))
            return

        def copy(done: Future[AppendedEvent]) -> None:
            error = done.exception()
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(done.result())

        pooled.add_done_callback(copy)

    def _drop(self, connection: psycopg.AsyncConnection[Any]) -> None:
        if self._connection is connection:
            self._connection = None
        self._close_later(connection)

    async def _connected(self) -> psycopg.AsyncConnection[Any]:
        """The loop's connection, opened anew when there is none or the server has ended it
        (an idle connection with something to read holds the server's goodbye)."""
        connection = self._connection
        if connection is not None and (connection.closed or has_input(connection.fileno())):
            self._drop(connection)
            connection = None
        if connection is None:
            assert self._conninfo is not None
            connection = await psycopg.AsyncConnection.connect(
                self._conninfo, autocommit=True, **self._connect_args
            )
            self._connection = connection
        return connection

    def _close_later(self, connection: psycopg.AsyncConnection[Any]) -> None:
        task = asyncio.get_running_loop().create_task(_close(connection))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self, timeout_s: float) -> None:
        """Let statements in flight finish within ``timeout_s``, then cancel them, and close
        the connection (on the loop that used it). The connection is closed before the
        cancelled tasks run: psycopg would otherwise ask the server to cancel the statement
        and wait for it (up to 10 s), and a stalled server answers neither."""
        pending: set[asyncio.Task[None]] = set()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
        connection, self._connection = self._connection, None
        if connection is not None:
            await _close(connection)
        if pending:
            await asyncio.wait(pending)


async def _close(connection: psycopg.AsyncConnection[Any]) -> None:
    with contextlib.suppress(psycopg.Error, OSError):
        await connection.close()
