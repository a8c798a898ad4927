"""Dedicated thread pools for the request path's blocking work, with a bound on database waits.

Starlette's ``run_in_threadpool`` shares anyio's one 40-thread pool between everything; when
engine waits or a stalled database fill it, authentication, audit writes and health checks
queue behind them with no bound. Here the database calls (key lookups, audit appends, pings)
and the CPU work of preparing prompts (templating, tokenizing) each have their own pool, and a
database call the caller waits for gives up after ``timeout_s``: the thread may stay blocked
until the database answers (a stopped server never answers a query, and its server-side
``statement_timeout`` cannot fire), but the request gets its answer in bounded time.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from gateway.audit.log import AuditUnavailableError

P = ParamSpec("P")
T = TypeVar("T")


def settled_on_loop(future: Future[T]) -> asyncio.Future[T]:
    """An asyncio future of the running loop that takes ``future``'s outcome. Settled by the
    loop's own thread (an append from the event loop, ``gateway.audit.loop_append``), it is
    settled at once; by another thread, through the loop's self-pipe, as ``wrap_future``
    does. Cancelling it (a wait that gives up) leaves ``future`` to complete."""
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    waiter: asyncio.Future[T] = loop.create_future()

    def settle(done: Future[T]) -> None:
        if waiter.done():
            return
        if done.cancelled():
            waiter.cancel()
            return
        error = done.exception()
        if error is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(done.result())

    def copy(done: Future[T]) -> None:
        if threading.get_ident() == loop_thread:
            settle(done)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(settle, done)

    future.add_done_callback(copy)
    return waiter


class Offload:
    def __init__(self, *, db_threads: int, prepare_threads: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._give_up_at: float | None = None
        self._single: dict[str, Future[Any]] = {}
        self._db = ThreadPoolExecutor(db_threads, thread_name_prefix="specgate-db")
        self._prepare = ThreadPoolExecutor(prepare_threads, thread_name_prefix="specgate-prep")
        self._io = ThreadPoolExecutor(2, thread_name_prefix="specgate-io")

    def submit_db(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Start ``fn`` on the database pool (in the caller's context: spans nest)."""
        context = contextvars.copy_context()
        return self._db.submit(functools.partial(context.run, fn, *args, **kwargs))

    def give_up_by(self, deadline: float) -> None:
        """From now on no database wait outlasts ``deadline`` (``time.monotonic()``): the end
        of the shutdown's grace period."""
        self._give_up_at = deadline

    def _wait_s(self) -> float:
        """``timeout_s``, or what is left before ``give_up_by``'s deadline if that is less."""
        if self._give_up_at is None:
            return self.timeout_s
        return max(0.0, min(self.timeout_s, self._give_up_at - time.monotonic()))

    async def wait_db(self, future: Future[T], what: str) -> T:
        """Await a database call started with ``submit_db``; raises AuditUnavailableError
        once ``timeout_s`` has passed, or the shutdown's deadline (the call itself goes on and
        may still complete)."""
        wait_s = self._wait_s()
        try:
            return await asyncio.wait_for(settled_on_loop(future), wait_s)
        except TimeoutError:
            raise AuditUnavailableError(
                f"audit store unavailable: {what} did not answer within {wait_s:g} s"
            ) from None

    async def db(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        what = getattr(fn, "__name__", "database call")
        return await self.wait_db(self.submit_db(fn, *args, **kwargs), what)

    async def db_shared(self, key: str, fn: Callable[[], T]) -> T:
        """Like ``db``, but callers with the same ``key`` share the call in flight: a stalled
        database then holds one thread for all health probes, not one per probe."""
        future = self._single.get(key)
        if future is None or future.done():
            future = self.submit_db(fn)
            self._single[key] = future
        result: T = await self.wait_db(future, key)
        return result

    def submit_io(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Start local file work (the spool's fsync) on its own thread, whatever the database."""
        context = contextvars.copy_context()
        return self._io.submit(functools.partial(context.run, fn, *args, **kwargs))

    async def io(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``submit_io``, awaited."""
        return await asyncio.wrap_future(self.submit_io(fn, *args, **kwargs))

    async def prepare(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run CPU-bound request preparation off the event loop."""
        context = contextvars.copy_context()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._prepare, functools.partial(context.run, fn, *args, **kwargs)
        )

    def close(self) -> None:
        """Stop taking work; threads blocked on a stalled database are not waited for."""
        self._db.shutdown(wait=False, cancel_futures=True)
        self._prepare.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=True)
