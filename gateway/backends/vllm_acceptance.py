"""Acceptance figures for requests a vLLM server did not report per request.

vLLM's Prometheus counters (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``) count over the whole server. Each speculative replica's
counters are scraped on an interval; the increase since the last scrape is attributed to
the requests that finished in that interval, in proportion to their output tokens, and the
audit event says so (``acceptance_source: "interval"``): with requests overlapping an
interval's edge, such a figure is the interval's, not exactly the request's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.backends.vllm_wire import SPEC_COUNTERS

DRAFTS, DRAFT_TOKENS, ACCEPTED = SPEC_COUNTERS


@dataclass(frozen=True)
class SpecFigures:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int


def split(total: int, weights: list[int]) -> list[int]:
    """``total`` in integer shares proportional to ``weights`` (largest remainders get the
    leftover units), summing exactly to ``total``."""
    weight_sum = sum(weights)
    if not weights:
        return []
    if weight_sum <= 0:
        weights = [1] * len(weights)
        weight_sum = len(weights)
    exact = [total * w / weight_sum for w in weights]
    shares = [int(x) for x in exact]
    leftover = total - sum(shares)
    order = sorted(range(len(weights)), key=lambda i: exact[i] - shares[i], reverse=True)
    for index in order[:leftover]:
        shares[index] += 1
    return shares


class IntervalAttribution:
    """One replica's counters at the last scrape and the requests waiting for the next.
    Used on the backend's event loop only."""

    def __init__(self) -> None:
        self._last: dict[str, float] | None = None
        self._waiting: list[tuple[int, asyncio.Future[SpecFigures]]] = []

    @property
    def waiting(self) -> bool:
        return bool(self._waiting)

    def wait(self, output_tokens: int) -> asyncio.Future[SpecFigures]:
        future: asyncio.Future[SpecFigures] = asyncio.get_running_loop().create_future()
        self._waiting.append((output_tokens, future))
        return future

    def settle(self, counters: dict[str, float] | None) -> None:
        """Give the waiting requests their shares of the increase since the last scrape;
        ``None`` (the scrape failed) gives them zeros, and the next scrape starts afresh."""
        waiting, self._waiting = self._waiting, []
        if counters is None or self._last is None:
            increase = {name: 0 for name in SPEC_COUNTERS}
        else:
            increase = {
                name: max(0, round(counters.get(name, 0.0) - self._last.get(name, 0.0)))
                for name in SPEC_COUNTERS
            }
        self._last = counters
        weights = [tokens for tokens, _ in waiting]
        shares = {name: split(increase[name], weights) for name in SPEC_COUNTERS}
        for index, (_, future) in enumerate(waiting):
            if not future.done():
                future.set_result(
                    SpecFigures(
                        shares[DRAFTS][index], shares[DRAFT_TOKENS][index], shares[ACCEPTED][index]
                    )
                )
