"""How many tokens each sequence of a batched step proposes, from what batched steps cost.

In the padded batch (``engine.batched_runner``) every sequence is fed as many rows as the
widest one, so one sequence proposing k makes the whole pass ``batch x (k + 1)`` rows. The
proposal length is therefore chosen for the batch: the k that maximises the batch's expected
committed tokens per second (``engine.adaptive.best_length`` over every sequence's own
acceptance curve), against the measured seconds of a step at this batch size and width
(``StepCosts``). On two CPU cores a pass's cost grows almost at once with its rows, so as the
batch grows k shrinks and reaches 0, where speculation stops paying: the crossover is a
measurement (``crossover``), not a setting.

A batch that has run plain steps for a while probes: one step in which every adaptive
sequence proposes one token, after ``PROBE_AFTER_PLAIN_STEPS`` plain steps per sequence in the
batch, so each sequence sees as much new evidence per plain step as it would alone while the
padded probe pass is paid as rarely.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from engine.adaptive import Candidate, Ewma, PassCosts, SpeculationLength, best_length
from engine.decoding import Speculation


class StepCosts:
    """Measured seconds of a batched step (pass, verification and commit of every sequence)
    by batch size and width (rows fed per sequence, padding included).

    Where a width has not been measured at a batch size, the one-sequence pass cost of as many
    rows (``PassCosts``, calibrated at load) stands in, scaled by what the nearest measured
    width at that batch size cost against its own stand-in: the shape of the curve from the
    calibration, its level from this batch size's real steps.
    """

    WEIGHT = PassCosts.WEIGHT

    def __init__(self, costs: PassCosts) -> None:
        self.costs = costs
        self._steps: dict[tuple[int, int], Ewma] = {}
        self._lock = threading.Lock()

    def record(self, batch: int, width: int, seconds: float) -> None:
        with self._lock:
            self._steps.setdefault((batch, width), Ewma(self.WEIGHT)).update(seconds)

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


class BatchSpeculation:
    """Chooses every sequence's proposal length for one batched step."""

    PROBE_AFTER_PLAIN_STEPS = SpeculationLength.PROBE_AFTER_PLAIN_STEPS

    def __init__(self, steps: StepCosts) -> None:
        self.steps = steps
        self.plain_run = 0  # plain steps in a row the batch chose

    def lengths(self, sequences: list[Sequence]) -> list[int]:
        batch = len(sequences)
        candidates: list[Candidate | None] = [_candidate(seq) for seq in sequences]
        present = [c for c in candidates if c is not None]
        k = best_length(present, _at_batch(self.steps, batch))
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
            self.plain_run = 0
            return chosen
        self.plain_run += 1
        if self.plain_run > self.PROBE_AFTER_PLAIN_STEPS * batch:
            self.plain_run = 0
            for i in adaptive:
                chosen[i] = 1
            return chosen
        for i in adaptive:
            _length(sequences[i]).plain_steps += 1
        return chosen


def _length(seq: Sequence) -> SpeculationLength:
    assert seq.speculation is not None
    return seq.speculation.length


def _candidate(seq: Sequence) -> Candidate | None:
    speculation = seq.speculation
    if speculation is None:
        return None
    cap = max(0, seq.remaining - 1)
    length = speculation.length
    if speculation.schedule is not None or speculation.fixed_k is not None:
        forced = min(speculation.next_k(seq.step), cap)
        return Candidate(length.survival(), length.costs.proposer(length.method), cap, forced)
    return length.candidate(cap)


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
