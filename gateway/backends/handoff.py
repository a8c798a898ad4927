"""A ``Generation`` fed from one thread (a backend's worker loop) and read on another event
loop (the gateway's): deltas go through a thread-safe queue and the reader's loop is woken
with ``call_soon_threadsafe``, so waiting holds no thread."""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import AsyncIterator, Callable

from engine.types import GenerationResult, StreamDelta, TokenLogprob


class HandedOffGeneration:
    def __init__(self, on_cancel: Callable[[], None]) -> None:
        self._deltas: queue.Queue[StreamDelta | BaseException] = queue.Queue()
        self._on_cancel = on_cancel
        self._waker: Callable[[], None] | None = None
        self._token_ids: list[int] = []
        self._text: list[str] = []
        # None until a delta carries logprobs (the request asked for them).
        self._logprobs: list[TokenLogprob] | None = None
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        self._on_cancel()

    def put(self, item: StreamDelta | BaseException) -> None:
        self._deltas.put(item)
        waker = self._waker
        if waker is not None:
            with contextlib.suppress(RuntimeError):  # the reading loop closed: none listens
                waker()

    def _take(self, item: StreamDelta | BaseException) -> StreamDelta:
        if isinstance(item, BaseException):
            raise item
        self._token_ids.extend(item.token_ids)
        self._text.append(item.text)
        if item.logprobs is not None:
            self._logprobs = [*(self._logprobs or ()), *item.logprobs]
        return item

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(ready.set)

        self._waker = wake
        try:
            while True:
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

    async def result_async(self) -> GenerationResult:
        last: StreamDelta | None = None
        async for delta in self.deltas():
            last = delta
        if last is None or last.finish_reason is None or last.stats is None:
            raise RuntimeError("generation ended without a final delta")
        logprobs = None if self._logprobs is None else tuple(self._logprobs)
        return GenerationResult(
            tuple(self._token_ids), "".join(self._text), last.finish_reason, last.stats, logprobs
        )
