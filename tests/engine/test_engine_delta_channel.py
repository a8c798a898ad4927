"""The delta channel both the engine's RequestHandle and the vLLM backend hand deltas through:
fed on one thread, read on another, blocking or from an event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.api.delta_channel import DeltaChannel
from engine.api.types import GenerationStats, StreamDelta, TokenLogprob


def _deltas(n: int, logprobs: bool = False) -> list[StreamDelta]:
    out = []
    for i in range(n):
        lp = (TokenLogprob(i, f"t{i}", (116,), -0.5),) if logprobs else None
        last = i == n - 1
        out.append(
            StreamDelta(
                f"t{i}",
                (i,),
                "length" if last else None,
                GenerationStats(method="none", num_output_tokens=n) if last else None,
                lp,
            )
        )
    return out


def _feed(channel: DeltaChannel, items: list[StreamDelta], pause: float = 0.0) -> threading.Thread:
    def run() -> None:
        for item in items:
            if pause:
                threading.Event().wait(pause)
            channel.put(item)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("n", [1, 2, 5])
def test_blocking_read_to_the_end_then_result_returns_at_once(n: int) -> None:
    channel = DeltaChannel()
    _feed(channel, _deltas(n), pause=0.001).join()
    taken = list(channel)
    assert [d.token_ids for d in taken] == [(i,) for i in range(n)]
    result = channel.result()  # would block forever if it waited for another delta
    assert result.token_ids == tuple(range(n))
    assert result.text == "".join(f"t{i}" for i in range(n))
    assert result.finish_reason == "length"
    assert result.logprobs is None


@pytest.mark.parametrize("n", [1, 3])
def test_async_read_to_the_end_then_result_async_returns_at_once(n: int) -> None:
    async def read() -> tuple[list[StreamDelta], tuple[int, ...]]:
        channel = DeltaChannel()
        thread = _feed(channel, _deltas(n), pause=0.002)
        taken = [d async for d in channel.deltas()]
        result = await asyncio.wait_for(channel.result_async(), timeout=2)
        thread.join()
        return taken, result.token_ids

    taken, ids = asyncio.run(read())
    assert len(taken) == n
    assert ids == tuple(range(n))


def test_final_only_wakes_the_loop_once_at_the_end() -> None:
    wakes = 0

    async def read() -> tuple[int, ...]:
        nonlocal wakes
        channel = DeltaChannel()
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counting(callback, *args):  # type: ignore[no-untyped-def]
            nonlocal wakes
            wakes += 1
            return original(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        result_task = asyncio.ensure_future(channel.result_async())
        await asyncio.sleep(0.01)  # the reader is waiting
        thread = _feed(channel, _deltas(6), pause=0.002)
        result = await asyncio.wait_for(result_task, timeout=2)
        thread.join()
        return result.token_ids

    assert asyncio.run(read()) == tuple(range(6))
    assert wakes == 1


def test_an_error_put_by_the_producer_is_raised_to_the_reader() -> None:
    channel = DeltaChannel()
    channel.put(_deltas(2)[0])
    channel.put(RuntimeError("replica went away"))
    with pytest.raises(RuntimeError, match="replica went away"):
        channel.result()

    async def read_async() -> None:
        other = DeltaChannel()
        other.put(RuntimeError("closed"))
        await other.result_async()

    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(read_async())


def test_cancel_sets_the_flag_and_calls_back() -> None:
    called = []
    channel = DeltaChannel(on_cancel=lambda: called.append(True))
    assert not channel.cancelled
    channel.cancel()
    assert channel.cancelled and called == [True]


def test_logprobs_are_kept_only_when_asked_for() -> None:
    kept = DeltaChannel(keep_logprobs=True)
    for item in _deltas(3, logprobs=True):
        kept.put(item)
    result = kept.result()
    assert result.logprobs is not None
    assert [lp.token_id for lp in result.logprobs] == [0, 1, 2]
    dropped = DeltaChannel()
    for item in _deltas(3, logprobs=True):
        dropped.put(item)
    assert dropped.result().logprobs is None

