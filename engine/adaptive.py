"""Adaptive speculation: how many tokens to propose, and when to stop proposing at all.

``SpeculationLength`` picks k per step to maximise expected tokens per second, from the
acceptance rate seen so far and the measured cost of draft and target passes.
``FallbackMonitor`` tracks acceptance per method over a rolling window of draft tokens and
switches a method off when it stays below the threshold, probing now and then to switch it
back on. Every switch is reported as a ``FallbackEvent``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from engine.types import FallbackEvent, Method


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per target pass with k proposals at acceptance rate alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def theoretical_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Speedup over plain decoding when one proposal pass costs ``cost_ratio`` target passes."""
    return expected_tokens(alpha, k) / (k * cost_ratio + 1.0)


class _Ewma:
    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.value: float | None = None

    def update(self, sample: float) -> None:
        self.value = (
            sample if self.value is None else self.value + self.weight * (sample - self.value)
        )


class SpeculationLength:
    """Per-request choice of k from acceptance and measured pass costs.

    Target pass time is modelled as ``base + per_token * tokens`` (fitted from the passes
    seen), a draft pass as a constant; k maximises expected tokens / expected step time.
    """

    PRIOR_TOKENS = 8.0

    def __init__(self, max_k: int, prior_alpha: float, proposal_cost: bool) -> None:
        self.max_k = max_k
        self.prior_alpha = prior_alpha
        self.proposal_cost = proposal_cost
        self.proposed = 0
        self.accepted = 0
        self.draft_pass = _Ewma(0.2)
        self.target_one = _Ewma(0.2)
        self.target_many = _Ewma(0.2)
        self.many_tokens = _Ewma(0.2)

    @property
    def alpha(self) -> float:
        prior = self.PRIOR_TOKENS
        return (self.accepted + prior * self.prior_alpha) / (self.proposed + prior)

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted

    def record_draft_pass(self, seconds: float) -> None:
        self.draft_pass.update(seconds)

    def record_target_pass(self, tokens: int, seconds: float) -> None:
        if tokens == 1:
            self.target_one.update(seconds)
        else:
            self.target_many.update(seconds)
            self.many_tokens.update(tokens)

    def _target_time(self, tokens: int) -> float:
        one = self.target_one.value
        many = self.target_many.value
        if one is None or many is None or self.many_tokens.value is None:
            return 1.0  # no measurements yet: treat passes as equally expensive
        span = self.many_tokens.value - 1.0
        per_token = max(0.0, (many - one) / span) if span > 0 else 0.0
        return one + per_token * (tokens - 1)

    def choose(self) -> int:
        alpha = min(self.alpha, 0.999)
        draft = (self.draft_pass.value or 0.0) if self.proposal_cost else 0.0
        if self.target_one.value is None:
            draft = 0.0
        best_k, best_rate = 1, 0.0
        for k in range(1, self.max_k + 1):
            rate = expected_tokens(alpha, k) / (k * draft + self._target_time(k + 1))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k


class FallbackMonitor:
    """Rolling acceptance per method; switches a method off below ``threshold`` and back on.

    Thread-safe: requests record from the engine's worker, the gateway reads the state.
    """

    def __init__(
        self,
        model: str,
        threshold: float,
        window_tokens: int,
        probe_interval: int,
        listener: Callable[[FallbackEvent], None] | None,
    ) -> None:
        self.model = model
        self.threshold = threshold
        self.window_tokens = window_tokens
        self.probe_interval = probe_interval
        self.listener = listener
        self._lock = threading.Lock()
        self._windows: dict[Method, deque[tuple[int, int]]] = {}
        self._disabled: dict[Method, int] = {}  # method -> requests seen while switched off

    def _window(self, method: Method) -> deque[tuple[int, int]]:
        return self._windows.setdefault(method, deque())

    def rate(self, method: Method) -> tuple[float, int]:
        """Acceptance rate and number of draft tokens in the method's window."""
        with self._lock:
            return self._rate(method)

    def _rate(self, method: Method) -> tuple[float, int]:
        window = self._window(method)
        proposed = sum(p for p, _ in window)
        accepted = sum(a for _, a in window)
        return (accepted / proposed if proposed else 1.0), proposed

    def is_disabled(self, method: Method) -> bool:
        with self._lock:
            return method in self._disabled

    def disabled_methods(self) -> set[Method]:
        with self._lock:
            return set(self._disabled)

    def admit(self, method: Method) -> bool:
        """Whether a new request may speculate with ``method``; every Nth one probes."""
        with self._lock:
            if method not in self._disabled:
                return True
            self._disabled[method] += 1
            return self._disabled[method] % self.probe_interval == 0

    def record(self, method: Method, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        event = None
        with self._lock:
            window = self._window(method)
            window.append((proposed, accepted))
            total = sum(p for p, _ in window)
            while window and total - window[0][0] >= self.window_tokens:
                total -= window.popleft()[0]
            rate, tokens = self._rate(method)
            if tokens < self.window_tokens:
                return
            if method not in self._disabled and rate < self.threshold:
                self._disabled[method] = 0
                window.clear()
                event = self._event(method, "disabled", rate, tokens, "below")
            elif method in self._disabled and rate >= self.threshold:
                del self._disabled[method]
                event = self._event(method, "enabled", rate, tokens, "recovered to")
        if event is not None and self.listener is not None:
            self.listener(event)

    def _event(
        self, method: Method, action: str, rate: float, tokens: int, verb: str
    ) -> FallbackEvent:
        reason = (
            f"acceptance rate {rate:.3f} over the last {tokens} draft tokens {verb} "
            f"threshold {self.threshold:.3f}"
        )
        return FallbackEvent(
            method=method,
            model=self.model,
            action="disabled" if action == "disabled" else "enabled",
            reason=reason,
            acceptance_rate=rate,
            window_tokens=tokens,
            threshold=self.threshold,
        )
