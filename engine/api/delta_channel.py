"""One generation's deltas, handed from the thread that produces them (the engine's worker, a
remote backend's loop) to whoever reads them: a blocking iterator for threads, an async
iterator for an event loop that waits without holding a thread (the producer wakes the loop
with ``call_soon_threadsafe``).

The channel remembers the last delta once taken, so ``result()`` after a reader took the
stream to its end returns at once instead of waiting for a delta that never comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from engine.api.types import GenerationResult, StreamDelta, TokenLogprob


class DeltaChannel:
    """``put`` from the producing thread; iterate, ``async for`` over ``deltas()``, or call
    ``result()`` / ``result_async()`` to read. ``keep_logprobs``: the result carries the
    deltas' log-probabilities (None otherwise). ``on_cancel`` runs once ``cancel()`` is
    called (a remote backend cancels its request there); producers may also poll
    ``cancelled``."""

    def __init__(
        self, *, keep_logprobs: bool = False, on_cancel: Callable[[], None] | None = None
    ) -> None:
        self._deltas: queue.Queue[StreamDelta | BaseException] = queue.Queue()
        self._cancelled = threading.Event()
        self._on_cancel = on_cancel
        self._keep_logprobs = keep_logprobs
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._final: StreamDelta | None = None  # the last delta, once taken
        self._waker: Callable[[], None] | None = None
        self._wake_on_final_only = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()
        if self._on_cancel is not None:
            self._on_cancel()

    def put(self, item: StreamDelta | BaseException) -> None:
        """A delta, or an error that ends the generation (raised to the reader)."""
        self._deltas.put(item)
        waker = self._waker
        final = isinstance(item, BaseException) or item.finish_reason is not None
        if waker is not None and (final or not self._wake_on_final_only):
            with contextlib.suppress(RuntimeError):  # the waiting loop closed: none listens
                waker()

    def _take(self, item: StreamDelta | BaseException) -> StreamDelta:
        if isinstance(item, BaseException):
            raise item
        self._token_ids.extend(item.token_ids)
        self._text.append(item.text)
        if item.logprobs:
            self._logprobs.extend(item.logprobs)
        if item.finish_reason is not None:
            self._final = item
        return item

    def __iter__(self) -> Iterator[StreamDelta]:
        """The deltas not yet taken, blocking the calling thread between them."""
        while self._final is None:
            item = self._take(self._deltas.get())
            yield item
            if item.finish_reason is not None:
                return

    async def deltas(self, final_only: bool = False) -> AsyncIterator[StreamDelta]:
        """The deltas not yet taken, awaited on the running event loop; with ``final_only``
        the loop is woken once, when the last delta (or an error) arrives, not per token."""
        self._wake_on_final_only = final_only
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(ready.set)

        self._waker = wake
        try:
            while self._final is None:
                try:
                    item = self._take(self._deltas.get_nowait())
                except queue.Empty:
                    await ready.wait()
                    ready.clear()
                    continue
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._waker = None

    def _result(self) -> GenerationResult:
        last = self._final
        if last is None or last.finish_reason is None or last.stats is None:
            raise RuntimeError("generation ended without a final delta")
        return GenerationResult(
            tuple(self._token_ids),
            "".join(self._text),
            last.finish_reason,
            last.stats,
            tuple(self._logprobs) if self._keep_logprobs else None,
        )

    def result(self) -> GenerationResult:
        for _ in self:
            pass
        return self._result()

    async def result_async(self) -> GenerationResult:
        async for _ in self.deltas(final_only=True):
            pass
        return self._result()
