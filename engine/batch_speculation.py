"""How many tokens each sequence of a batched step proposes, from what batched steps cost.

In the padded batch (``engine.batched_runner``) every sequence is fed as many rows as the
widest one, so one sequence proposing k makes the whole pass ``batch x (k + 1)`` rows. The
proposal length is therefore chosen for the batch: the k that maximises the batch's expected
committed tokens per second (``engine.adaptive.best_length`` over every sequence's own
acceptance curve), against the measured seconds of a step at this batch size and width
(``StepCosts``). On two CPU cores a pass's cost grows almost at once with its rows, so as the
batch grows k shrinks and reaches 0, where speculation stops paying: the crossover is a
measurement (``crossover``), not a setting.

A batch that runs plain steps costs a plain step: no proposer runs (a draft model's cache
falls behind and catches up in one shared pass when speculation resumes,
``engine.proposers.batched_draft``), and the choice only leaves plain steps for a k that beats
them by ``SWITCH_MARGIN``, with the catch-up it will cost counted (``Candidate.resume_seconds``),
so it does not flip with the noise of the measured step costs. Now and then it probes: a
step in which adaptive sequences propose one token, after ``PROBE_AFTER_PLAIN_STEPS`` plain
steps per sequence in the batch (so each sequence sees as much new evidence per plain step as
it would alone while the padded probe pass is paid as rarely). In a shared batch a proposer
that must first catch up (a draft that fell behind) probes only within a budget of
``PROBE_SHARE`` of the plain steps' time since the last probe, the cheapest first: catching
drafts up for probes costs a plain batch at most that share, however far behind they are.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine.adaptive import Candidate, PassCosts, SpeculationLength, best_length
from engine.decoding import Speculation


class RecentMedian:
    """The median of the last ``size`` samples: a pass descheduled on a shared machine moves
    it not at all (an exponential mean moved by a tenth of every stall, and the choice of k
    with it), while a lasting change of cost moves it within ``size / 2`` samples."""

    def __init__(self, size: int) -> None:
        self._samples: deque[float] = deque(maxlen=size)
        self.value: float | None = None  # kept up to date: the choice of k reads it often

    def update(self, sample: float) -> None:
        self._samples.append(sample)
        self.value = statistics.median(self._samples)


class StepCosts:
    """Measured seconds of a batched step (pass, verification and commit of every sequence)
    by batch size and width (rows fed per sequence, padding included).

    Where a width has not been measured at a batch size, the one-sequence pass cost of as many
    rows (``PassCosts``, calibrated at load) stands in, scaled by what the nearest measured
    width at that batch size cost against its own stand-in: the shape of the curve from the
    calibration, its level from this batch size's real steps.
    """

    SAMPLES = 15  # the recent steps of one batch size and width whose median is its cost

    def __init__(self, costs: PassCosts) -> None:
        self.costs = costs
        self._steps: dict[tuple[int, int], RecentMedian] = {}
        self._lock = threading.Lock()

    def record(self, batch: int, width: int, seconds: float) -> None:
        with self._lock:
            self._steps.setdefault((batch, width), RecentMedian(self.SAMPLES)).update(seconds)

    def seconds(self, batch: int, width: int) -> float | None:
        """The step's cost, never below a narrower measured step's: a wider pass does all
        of a narrower one's work and more, so a lower figure is noise on a shared machine
        (it would make speculating look cheaper than plain decoding)."""
        with self._lock:
            measured = {
                w: e.value
                for (b, w), e in self._steps.items()
                if b == batch and e.value is not None
            }
        estimate = self._estimate(batch, width, measured)
        narrower = [measured[w] for w in measured if w < width]
        if estimate is None or not narrower:
            return estimate
        return max(estimate, *narrower)

    def _estimate(self, batch: int, width: int, measured: dict[int, float]) -> float | None:
        if width in measured:
            return measured[width]
        stand_in = self.costs.target(batch * width)
        if not measured:
            return stand_in
        nearest = min(measured, key=lambda w: (abs(w - width), w))
        if stand_in is None:  # nothing calibrated: the nearest measured width's cost
            return measured[nearest]
        scale = self.costs.target(batch * nearest)
        return stand_in * measured[nearest] / scale if scale else measured[nearest]


@dataclass(frozen=True)
class Sequence:
    """What the length choice needs of one decoding sequence."""

    speculation: Speculation | None
    step: int  # target passes so far (a replayed schedule is indexed by it)
    remaining: int  # tokens it may still commit
    catch_up: int = 0  # committed tokens its proposer must feed before it can propose again


class BatchSpeculation:
    """Chooses every sequence's proposal length for one batched step."""

    PROBE_AFTER_PLAIN_STEPS = SpeculationLength.PROBE_AFTER_PLAIN_STEPS
    # The most of a plain batch's time that its probes may cost beyond plain steps.
    PROBE_SHARE = 0.02
    # How much better another k must look than the one chosen last to replace it.
    SWITCH_MARGIN = 0.05

    def __init__(self, steps: StepCosts) -> None:
        self.steps = steps
        self.plain_run = 0  # plain steps in a row the batch chose
        self.plain_seconds = 0.0  # their estimated cost
        self.last_k: int | None = None  # the batch's k at the last step (None: no step yet)

    def lengths(self, sequences: list[Sequence]) -> list[int]:
        batch = len(sequences)
        candidates: list[Candidate | None] = [_candidate(seq) for seq in sequences]
        present = [c for c in candidates if c is not None]
        k = best_length(present, _at_batch(self.steps, batch), self.last_k, self.SWITCH_MARGIN)
        # A step where no sequence may propose (none, or all at their last token: a request
        # alone ends so) sets no incumbent: the next request's choice starts fresh.
        self.last_k = k if any(c.cap > 0 or c.forced for c in present) else None
        chosen = [0 if c is None else c.proposes(k) for c in candidates]
        adaptive = [
            i for i, c in enumerate(candidates) if c is not None and c.forced is None and c.cap > 0
        ]
        if k > 0:
            # After a fully accepted step a sequence looks one token further (as alone), only
            # while speculating pays at all: a probe's lucky token must not buy a wider step
            # the cost model has just priced out (at batch 1 as in a batch).
            for i in adaptive:
                length = _length(sequences[i])
                if length.explore_from:
                    cap = min(length.max_k, sequences[i].remaining - 1)
                    chosen[i] = max(chosen[i], min(length.explore_from + 1, cap))
        if not adaptive:
            return chosen
        if max(chosen[i] for i in adaptive) > 0:
            self.plain_run, self.plain_seconds = 0, 0.0
            return chosen
        self.plain_run += 1
        self.plain_seconds += self.steps.seconds(batch, 1) or 0.0
        probing = (
            self._probing(batch, [(i, candidates[i]) for i in adaptive])
            if self.plain_run > self.PROBE_AFTER_PLAIN_STEPS * batch
            else []
        )
        if probing:
            self.plain_run, self.plain_seconds = 0, 0.0
            for i in probing:
                chosen[i] = 1
        for i in adaptive:
            if not chosen[i]:
                _length(sequences[i]).plain_steps += 1
        return chosen

    def _probing(self, batch: int, adaptive: list[tuple[int, Candidate | None]]) -> list[int]:
        """The sequences that probe now. Alone, the sequence (as the one-request loop does).
        In a shared batch, those whose proposers need no catch-up (an n-gram lookup, heads,
        a draft that is current), then the ones cheapest to catch up, as many as the budget
        holds: ``PROBE_SHARE`` of the plain steps' time since the last probe."""
        if batch == 1:
            return [i for i, _ in adaptive]
        budget = self.PROBE_SHARE * self.plain_seconds
        priced = sorted((c.resume_seconds, i) for i, c in adaptive if c is not None)
        probing: list[int] = []
        for seconds, i in priced:
            if seconds > budget:
                break
            budget -= seconds
            probing.append(i)
        return probing


def _length(seq: Sequence) -> SpeculationLength:
    assert seq.speculation is not None
    return seq.speculation.length


def _candidate(seq: Sequence) -> Candidate | None:
    speculation = seq.speculation
    if speculation is None:
        return None
    cap = max(0, seq.remaining - 1)
    length = speculation.length
    resume = length.costs.catch_up(length.method, seq.catch_up)
    if speculation.schedule is not None or speculation.fixed_k is not None:
        forced = min(speculation.next_k(seq.step), cap)
        return replace(
            length.candidate(cap), forced=forced, resume_seconds=resume, tokens_left=seq.remaining
        )
    return replace(length.candidate(cap), resume_seconds=resume, tokens_left=seq.remaining)


def crossover(steps: StepCosts, length: SpeculationLength, max_batch: int) -> float:
    """The smallest batch size at which a batch of sequences that all have ``length``'s
    acceptance curve chooses plain steps (k = 0) from the measured step costs; inf where
    speculating pays up to ``max_batch``."""
    candidate = length.candidate()
    for batch in range(1, max_batch + 1):
        if best_length([candidate] * batch, _at_batch(steps, batch)) == 0:
            return float(batch)
    return float("inf")


def _at_batch(steps: StepCosts, batch: int) -> Callable[[int], float | None]:
    return lambda width: steps.seconds(batch, width)
