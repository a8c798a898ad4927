"""How many prompt tokens a prefill chunk may take so that its pass stays within a time bound.

A request arriving while a long prompt is being prefilled waits for the chunk pass in flight
before its own prefill and first decode pass run (``engine.serving.scheduler``). A fixed chunk of
``long_prefill_token_threshold`` tokens bounds that wait in tokens, not in time: the same
chunk costs a hundred times more on a small CPU in float32 than on a GPU, so on such a CPU a
short request behind a long prompt would wait over a second for its first token (figures:
bench/results/2026-12-06-engine-batching-and-kernels.md). ``PrefillPace`` measures
what the chunk passes served cost per prompt token and cuts chunks so that a pass is
predicted to take at most ``max_seconds``; where passes are faster than that, the token
threshold alone applies, as before.

The per-token cost is ``(seconds - one-token pass) / tokens`` of recent chunk passes (the
one-token pass, calibrated at load, is the part of a pass that does not grow with its rows:
reading the weights), so a chunk of ``limit`` tokens is predicted to cost one-token pass +
``limit`` x per-token. The median of the recent passes follows the cost as the context
grows (attention over more positions) and ignores a pass descheduled on shared cores.
"""

from __future__ import annotations

from engine.speculation.adaptive import PassCosts
from engine.speculation.batch_speculation import RecentMedian

# The fewest tokens a chunk is cut to, whatever the bound: on a machine so slow that even
# this many overrun it, prefill still advances by passes that are mostly rows, not overhead.
MIN_CHUNK_TOKENS = 16

# Chunk passes smaller than this say little about the cost per token (their time is mostly
# the fixed part of a pass), so they are not recorded.
MIN_MEASURED_TOKENS = 8


class PrefillPace:
    SAMPLES = 5  # the recent chunk passes whose median cost per token is the estimate

    def __init__(self, max_seconds: float | None, costs: PassCosts) -> None:
        self.max_seconds = max_seconds
        self.costs = costs
        self._per_token = RecentMedian(self.SAMPLES)

    def record(self, tokens: int, seconds: float) -> None:
        """One prefill chunk pass of ``tokens`` prompt tokens took ``seconds``."""
        if tokens >= MIN_MEASURED_TOKENS:
            self._per_token.update(max(seconds - self._fixed(), 0.0) / tokens)

    def limit(self, threshold: int) -> int:
        """Most tokens of the next chunk: ``threshold``, cut to what ``max_seconds`` allows
        at the measured cost (never below ``MIN_CHUNK_TOKENS``)."""
        per_token = self._per_token.value
        if self.max_seconds is None or not per_token:
            return threshold
        fits = int((self.max_seconds - self._fixed()) / per_token)
        return min(threshold, max(fits, MIN_CHUNK_TOKENS))

    def _fixed(self) -> float:
        return self.costs.target(1) or 0.0
