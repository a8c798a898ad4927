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


class PassCosts:
    """Measured seconds of a target pass by number of tokens fed, and of one proposer pass.

    Shared by all requests of an engine: calibrated when the engine loads (a request that
    always speculates never runs a one-token pass, so it could not measure that cost itself)
    and refined by every pass served.
    """

    WEIGHT = 0.1

    def __init__(self) -> None:
        self._target: dict[int, _Ewma] = {}
        self._proposer: dict[str, _Ewma] = {}
        self._lock = threading.Lock()

    def record_target(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._target.setdefault(tokens, _Ewma(self.WEIGHT)).update(seconds)

    def record_proposer(self, method: str, seconds: float) -> None:
        with self._lock:
            self._proposer.setdefault(method, _Ewma(self.WEIGHT)).update(seconds)

    def proposer(self, method: str) -> float:
        with self._lock:
            ewma = self._proposer.get(method)
            return ewma.value if ewma is not None and ewma.value is not None else 0.0

    def target(self, tokens: int) -> float | None:
        """Seconds for a pass of ``tokens``, interpolated between measured sizes."""
        with self._lock:
            known = sorted((n, e.value) for n, e in self._target.items() if e.value is not None)
        if not known:
            return None
        below = [(n, t) for n, t in known if n <= tokens]
        above = [(n, t) for n, t in known if n >= tokens]
        if below and above:
            (n0, t0), (n1, t1) = below[-1], above[0]
        elif len(known) >= 2:
            (n0, t0), (n1, t1) = (known[-2], known[-1]) if below else (known[0], known[1])
        else:
            return known[0][1]
        if n1 == n0:
            return t0
        return max(0.0, t0 + (t1 - t0) * (tokens - n0) / (n1 - n0))


class RunLengths:
    """How long a proposer stays right, as Kaplan-Meier counts of accepted runs.

    Per position m: the steps that proposed beyond m and accepted at least m ("at risk"), and
    those among them whose run of accepted tokens stopped exactly at m. A step that accepted
    all it proposed is censored: it says nothing about later positions. With ``decay`` below 1
    older steps weigh less, so an engine-wide history follows a changing workload.
    """

    def __init__(self, max_k: int, decay: float = 1.0) -> None:
        self.max_k = max_k
        self.decay = decay
        self.at_risk = [0.0] * max_k
        self.stopped = [0.0] * max_k

    def record(self, proposed: int, accepted: int) -> None:
        if self.decay < 1.0:
            self.at_risk = [n * self.decay for n in self.at_risk]
            self.stopped = [n * self.decay for n in self.stopped]
        for m in range(min(accepted + 1, proposed, self.max_k)):
            self.at_risk[m] += 1
        if accepted < proposed and accepted < self.max_k:
            self.stopped[accepted] += 1

    def hazards(self, prior: float, weight: float) -> list[float]:
        """P(the run stops at m | it reached m) per position, shrunk toward a prior as if
        ``weight`` steps had shown it: ``prior`` for the first position, and for each later
        one the estimate before it (so positions without data carry it)."""
        estimates: list[float] = []
        hazard = prior
        for m in range(self.max_k):
            hazard = (self.stopped[m] + weight * hazard) / (self.at_risk[m] + weight)
            estimates.append(hazard)
        return estimates

    def scaled_to(self, steps: float) -> RunLengths:
        """A copy whose counts weigh at most ``steps`` steps, with the same shape."""
        copy = RunLengths(self.max_k)
        scale = min(1.0, steps / self.at_risk[0]) if self.at_risk[0] else 0.0
        copy.at_risk = [n * scale for n in self.at_risk]
        copy.stopped = [n * scale for n in self.stopped]
        return copy


class SpeculationLength:
    """Per-request choice of k from how long the proposer stays right and what passes cost.

    Acceptance is bursty (a draft is right for long runs where the text is predictable, an
    n-gram lookup while the output copies the prompt), so instead of one per-token rate this
    keeps the survival curve S(j) = P(the first j proposals are accepted), from this request's
    steps shrunk toward the engine-wide curve of the method (``history``, shared by all
    requests, so a short request does not start from nothing). Expected tokens per pass with k
    proposals is 1 + S(1) + ... + S(k); k maximises that over (k * proposer pass + target pass
    of k + 1 tokens). k = 0, a plain step, wins when no proposal length pays for itself. After a
    step that accepted all it proposed, the next one proposes at least one token more:
    otherwise a long run would be censored at the current k and never be seen.
    """

    PRIOR_STEPS = 4.0  # weight of the method's rolling acceptance rate
    HISTORY_STEPS = 8.0  # most weight the engine-wide curve gets in a request's curve

    def __init__(
        self,
        max_k: int,
        prior_alpha: float,
        costs: PassCosts,
        method: str,
        history: RunLengths | None = None,
    ) -> None:
        self.max_k = max_k
        self.prior_alpha = prior_alpha
        self.costs = costs
        self.method = method
        self.history = history
        self.runs = (
            history.scaled_to(self.HISTORY_STEPS) if history is not None else RunLengths(max_k)
        )
        self.explore_from = 0  # after a fully accepted step: its k

    def record(self, proposed: int, accepted: int) -> None:
        self.runs.record(proposed, accepted)
        if self.history is not None:
            self.history.record(proposed, accepted)
        self.explore_from = proposed if proposed and accepted == proposed else 0

    def survival(self) -> list[float]:
        """S(1) .. S(max_k)."""
        alive, curve = 1.0, []
        for hazard in self.runs.hazards(1.0 - self.prior_alpha, self.PRIOR_STEPS):
            alive *= 1.0 - hazard
            curve.append(alive)
        return curve

    def choose(self) -> int:
        plain = self.costs.target(1)
        if plain is None:
            return self.max_k  # nothing measured yet: every pass costs the same
        proposal = self.costs.proposer(self.method)
        best_k, best_rate = 0, 1.0 / plain if plain > 0 else 0.0
        expected = 1.0
        for k, alive in enumerate(self.survival(), start=1):
            expected += alive
            rate = expected / (k * proposal + (self.costs.target(k + 1) or plain))
            if rate > best_rate:
                best_k, best_rate = k, rate
        if self.explore_from:
            return max(best_k, min(self.explore_from + 1, self.max_k))
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
