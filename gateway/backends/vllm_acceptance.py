"""A vLLM request's acceptance figures: its own, or its share of an interval's.

A server started with ``--per-request-spec-decode-metrics`` reports each request's figures
in its closing usage chunk, with ``acceptance_histogram`` (entry j: speculative steps that
accepted j draft tokens), from which the accepted tokens by position follow
(``per_position``).

Otherwise vLLM's Prometheus counters (``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos``)
count over the whole server. Each speculative replica's counters are scraped on an interval;
the increase since the last scrape is attributed to the requests that finished in that
interval, in proportion to their output tokens, and the audit event says so
(``acceptance_source: "interval"``): with requests overlapping an interval's edge, such a
figure is the interval's, not exactly the request's.

Accepted tokens by position are reported as the built-in engine reports them
(``engine.api.types.GenerationStats.num_accepted_tokens_per_pos``): entry i counts the steps that
accepted more than i tokens, up to the last position with any.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.backends.vllm_wire import SPEC_COUNTERS

DRAFTS, DRAFT_TOKENS, ACCEPTED = SPEC_COUNTERS


@dataclass(frozen=True)
class SpecFigures:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...] = ()


def request_figures(per_request: dict[str, Any]) -> SpecFigures:
    """One request's figures from vLLM's per-request speculative metrics (its closing usage
    chunk's ``metrics.speculative_decoding``)."""
    return SpecFigures(
        int(per_request.get("num_spec_steps", 0)),
        int(per_request.get("num_draft_tokens", 0)),
        int(per_request.get("num_accepted_draft_tokens", 0)),
        per_position([int(n) for n in per_request.get("acceptance_histogram") or ()]),
    )


def counter_increase(before: dict[str, float], after: dict[str, float]) -> SpecFigures:
    """The increase of a server's ``vllm:spec_decode_*`` counters (``spec_counters``)
    between two reads."""
    drafts, draft_tokens, accepted = (
        max(0, round(after.get(name, 0.0) - before.get(name, 0.0))) for name in SPEC_COUNTERS
    )
    return SpecFigures(drafts, draft_tokens, accepted)


def without_trailing_zeros(counts: Sequence[int]) -> tuple[int, ...]:
    """``counts`` up to its last non-zero entry (the built-in engine's list has no more)."""
    end = len(counts)
    while end and not counts[end - 1]:
        end -= 1
    return tuple(counts[:end])


def per_position(histogram: Sequence[int]) -> tuple[int, ...]:
    """Accepted tokens by position from vLLM's per-request ``acceptance_histogram`` (entry j:
    steps that accepted j draft tokens): entry i is the steps that accepted more than i."""
    return without_trailing_zeros(
        [sum(histogram[i + 1 :]) for i in range(max(0, len(histogram) - 1))]
    )


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
        self._last_per_pos: list[float] = []
        self._waiting: list[tuple[int, asyncio.Future[SpecFigures]]] = []

    @property
    def waiting(self) -> bool:
        return bool(self._waiting)

    def wait(self, output_tokens: int) -> asyncio.Future[SpecFigures]:
        future: asyncio.Future[SpecFigures] = asyncio.get_running_loop().create_future()
        self._waiting.append((output_tokens, future))
        return future

    def settle(
        self, counters: dict[str, float] | None, accepted_per_pos: Sequence[float] = ()
    ) -> None:
        """Give the waiting requests their shares of the increase since the last scrape
        (``counters`` by name, ``accepted_per_pos`` by position); ``None`` (the scrape
        failed) gives them zeros, and the next scrape starts afresh."""
        waiting, self._waiting = self._waiting, []
        if counters is None or self._last is None:
            increase = {name: 0 for name in SPEC_COUNTERS}
            position_increase = [0] * len(accepted_per_pos)
        else:
            increase = {
                name: max(0, round(counters.get(name, 0.0) - self._last.get(name, 0.0)))
                for name in SPEC_COUNTERS
            }
            before = [*self._last_per_pos, *[0.0] * len(accepted_per_pos)]
            position_increase = [
                max(0, round(now - before[i])) for i, now in enumerate(accepted_per_pos)
            ]
        self._last = counters
        self._last_per_pos = list(accepted_per_pos)
        weights = [tokens for tokens, _ in waiting]
        shares = {name: split(increase[name], weights) for name in SPEC_COUNTERS}
        position_shares = [split(total, weights) for total in position_increase]
        for index, (_, future) in enumerate(waiting):
            if not future.done():
                future.set_result(
                    SpecFigures(
                        shares[DRAFTS][index],
                        shares[DRAFT_TOKENS][index],
                        shares[ACCEPTED][index],
                        without_trailing_zeros([share[index] for share in position_shares]),
                    )
                )
