"""How many tokens each sequence of a batched step proposes, from what batched steps cost.

A batched step (``engine.models.batched_runner``) runs its products over each sequence's own rows
(attention alone sees them padded to the widest, and its compiled kernel skips the padding),
so a step costs about what its rows cost in all: ``batch`` plus the tokens proposed. Each
sequence's proposal length is chosen for the batch (``allocate``): the lengths that maximise
the batch's expected committed tokens per second, from every sequence's own acceptance curve
and the measured seconds of a step at this batch size and number of rows (``StepCosts``), so
a sequence whose proposals are right (a reply quoting its prompt) speculates beside others
that run plain. On two CPU cores a pass's cost grows almost at once with its rows, so as the
batch grows k shrinks and reaches 0, where speculation stops paying: the crossover is a
measurement (``crossover``), not a setting.

A batch that runs plain steps costs a plain step: no proposer runs (a draft model's cache
falls behind and catches up in one shared pass when speculation resumes,
``engine.speculation.proposers.draft``), and the choice only leaves plain steps for a k
that beats them by ``SWITCH_MARGIN``, with the catch-up it will cost counted
(``Candidate.resume_seconds``), so it does not flip with the noise of the measured step costs. Now
and then it probes: a step in which adaptive sequences propose one token, after
``PROBE_AFTER_PLAIN_STEPS`` plain steps per sequence in the batch (so each sequence sees as much new
evidence per plain step as it would alone while the probe pass, a row more per sequence, is paid as
rarely). In a shared batch a proposer that must first catch up (a draft that fell behind) probes
only within a budget of ``PROBE_SHARE`` of the plain steps' time since the last probe, the cheapest
first: catching drafts up for probes costs a plain batch at most that share, however far behind they
are. A sequence that runs plain beside speculating ones probes on its own (``_probe_beside``).
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine.speculation.adaptive import Candidate, PassCosts, SpeculationLength
from engine.speculation.request import Speculation


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
    by batch size and rows (all the sequences' rows together: ``batch`` for a plain step).

    Where a number of rows has not been measured at a batch size, the one-sequence pass cost
    of as many rows (``PassCosts``, calibrated at load) stands in, scaled by what the nearest
    measured number at that batch size cost against its own stand-in: the shape of the curve
    from the calibration, its level from this batch size's real steps.
    """

    SAMPLES = 15  # the recent steps of one batch size and number of rows whose median is its cost

    def __init__(self, costs: PassCosts) -> None:
        self.costs = costs
        self._steps: dict[tuple[int, int], RecentMedian] = {}
        self._lock = threading.Lock()

    def record(self, batch: int, rows: int, seconds: float) -> None:
        with self._lock:
            self._steps.setdefault((batch, rows), RecentMedian(self.SAMPLES)).update(seconds)

    def seconds(self, batch: int, rows: int) -> float | None:
        """The step's cost, never below a measured step's of fewer rows: a pass of more rows
        does all of a smaller one's work and more, so a lower figure is noise on a shared
        machine (it would make speculating look cheaper than plain decoding)."""
        with self._lock:
            measured = {
                r: e.value
                for (b, r), e in self._steps.items()
                if b == batch and e.value is not None
            }
        estimate = self._estimate(rows, measured)
        fewer = [measured[r] for r in measured if r < rows]
        if estimate is None or not fewer:
            return estimate
        return max(estimate, *fewer)

    def _estimate(self, rows: int, measured: dict[int, float]) -> float | None:
        if rows in measured:
            return measured[rows]
        stand_in = self.costs.target(rows)
        if not measured:
            return stand_in
        nearest = min(measured, key=lambda r: (abs(r - rows), r))
        if stand_in is None:  # nothing calibrated: the nearest measured size's cost
            return measured[nearest]
        scale = self.costs.target(nearest)
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
        # Each sequence's length at the last step, by its ``Speculation`` (None: no incumbent).
        self.last: dict[int, int] | None = None

    def lengths(self, sequences: list[Sequence]) -> list[int]:
        batch = len(sequences)
        candidates: list[Candidate | None] = [_candidate(seq) for seq in sequences]
        present = [c for c in candidates if c is not None]
        at_batch, plain_rows = _at_batch(self.steps, batch), batch - len(present)
        own = allocate(present, at_batch, plain_rows)
        speculations = [seq.speculation for seq in sequences if seq.speculation is not None]
        if self.last is not None and any(c.chooses for c in present):
            # The last step's lengths (0 for a sequence new to the batch) are kept unless the
            # new ones beat them by the margin.
            kept = [
                c.proposes(self.last.get(id(speculation), 0))
                for c, speculation in zip(present, speculations, strict=True)
            ]
            better = batch_rate(present, own, at_batch, plain_rows)
            if batch_rate(present, kept, at_batch, plain_rows) * (1 + self.SWITCH_MARGIN) >= better:
                own = kept
        # A step where no sequence may propose (none, or all at their last token: a request
        # alone ends so) sets no incumbent: the next request's choice starts fresh.
        self.last = (
            {id(speculation): k for speculation, k in zip(speculations, own, strict=True)}
            if any(c.cap > 0 or c.forced for c in present) else None
        )
        lengths = iter(own)
        chosen = [0 if c is None else next(lengths) for c in candidates]
        adaptive = [
            i for i, c in enumerate(candidates) if c is not None and c.chooses
        ]
        for i in adaptive:
            # After a fully accepted step a sequence looks one token further (as alone), only
            # while speculating pays for it: a probe's lucky token must not buy a longer
            # proposal the cost model has just priced out (at batch 1 as in a batch).
            length = _length(sequences[i])
            if chosen[i] and length.explore_from:
                cap = min(length.max_k, sequences[i].remaining - 1)
                chosen[i] = max(chosen[i], min(length.explore_from + 1, cap))
        if not adaptive:
            return chosen
        if max(chosen[i] for i in adaptive) > 0:
            self.plain_run, self.plain_seconds = 0, 0.0
            self._probe_beside(sequences, candidates, adaptive, chosen)
            return chosen
        for i in adaptive:
            _length(sequences[i]).plain_run = 0
        self.plain_run += 1
        self.plain_seconds += self.steps.seconds(batch, batch) or 0.0
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

    def _probe_beside(
        self,
        sequences: list[Sequence],
        candidates: list[Candidate | None],
        adaptive: list[int],
        chosen: list[int],
    ) -> None:
        """In a step where others speculate, a sequence that ran plain for more than
        ``PROBE_AFTER_PLAIN_STEPS`` such steps per sequence in the batch, in a row, proposes
        one token: without new evidence a pessimistic curve would keep it plain for as long
        as the others speculate. Its row is all a probe costs (no padding), so the batch pays
        at most a row per ``PROBE_AFTER_PLAIN_STEPS`` steps. Only proposers that need no
        catch-up probe so (a draft that fell behind waits for a plain batch's budgeted
        probe)."""
        for i in adaptive:
            length = _length(sequences[i])
            if chosen[i]:
                length.plain_run = 0
                continue
            candidate = candidates[i]
            assert candidate is not None  # an adaptive sequence's
            length.plain_run += 1
            if (
                length.plain_run > self.PROBE_AFTER_PLAIN_STEPS * len(sequences)
                and candidate.resume_seconds == 0.0
            ):
                length.plain_run = 0
                chosen[i] = 1
            else:
                length.plain_steps += 1

    def _probing(self, batch: int, adaptive: list[tuple[int, Candidate | None]]) -> list[int]:
        """The sequences that probe now. Alone, the sequence.
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


def allocate(
    candidates: list[Candidate],
    pass_seconds: Callable[[int], float | None],
    plain_rows: int = 0,
) -> list[int]:
    """Each candidate's proposal length: the batch's expected committed tokens per second
    (``plain_rows`` sequences that do not speculate commit one token a row; ``pass_seconds(r)``
    is the step's cost at r rows in all, plus the proposers' time), raised one candidate at a
    time from plain steps (a fixed k: its own), each time by the move, one sequence's length
    set to any longer one up to its cap, that raises the rate most, while one does. A step
    costs its rows, so a sequence whose proposals are right speculates beside others whose
    are not, which propose nothing."""
    ks = [c.proposes(0) for c in candidates]
    if not any(c.chooses for c in candidates):
        return ks  # nothing to choose: a fixed k is its own, a cap of 0 proposes nothing
    fed = plain_rows + len(candidates)
    if pass_seconds(fed + sum(ks)) is None:
        return [c.proposes(c.cap) for c in candidates]  # nothing measured: all cost the same
    costs: dict[int, float] = {}

    def cost(rows: int) -> float:
        if rows not in costs:
            costs[rows] = pass_seconds(rows) or 0.0
        return costs[rows]

    # Per candidate and length: tokens expected, rows proposed, proposer seconds.
    tables = [
        [(c.expected(c.proposes(k)), c.proposes(k), c.overhead(k)) for k in range(c.cap + 1)]
        if c.forced is None else [] for c in candidates
    ]
    tokens = plain_rows + sum(c.expected(k) for c, k in zip(candidates, ks, strict=True))
    rows = fed + sum(ks)
    overhead = sum(c.overhead(0) for c in candidates)
    current = tokens / (cost(rows) + overhead)
    while True:
        best: tuple[float, int, int] | None = None
        for i, table in enumerate(tables):
            if not table:
                continue
            now_tokens, now_rows, now_overhead = table[ks[i]]
            for k in range(ks[i] + 1, len(table)):
                more_tokens, more_rows, more_overhead = table[k]
                seconds = cost(rows + more_rows - now_rows) + overhead - now_overhead
                seconds += more_overhead
                gained = tokens + more_tokens - now_tokens
                rate = gained / seconds if seconds > 0 else float("inf")
                if best is None or rate > best[0]:
                    best = (rate, i, k)
        if best is None or best[0] <= current:
            return ks
        rate, i, k = best
        now_tokens, now_rows, now_overhead = tables[i][ks[i]]
        tokens += tables[i][k][0] - now_tokens
        rows += tables[i][k][1] - now_rows
        overhead += tables[i][k][2] - now_overhead
        ks[i], current = k, rate


def batch_rate(
    candidates: list[Candidate],
    lengths: list[int],
    pass_seconds: Callable[[int], float | None],
    plain_rows: int = 0,
) -> float:
    """Expected committed tokens per second of a step in which each candidate proposes its
    length and ``plain_rows`` sequences run plain (``allocate``'s objective)."""
    proposed = [c.proposes(k) for c, k in zip(candidates, lengths, strict=True)]
    tokens = plain_rows + sum(c.expected(n) for c, n in zip(candidates, proposed, strict=True))
    seconds = (pass_seconds(plain_rows + len(candidates) + sum(proposed)) or 0.0) + sum(
        c.overhead(k) for c, k in zip(candidates, lengths, strict=True)
    )
    return tokens / seconds if seconds > 0 else float("inf")


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
    forced_k = speculation.forced_k(seq.step)
    if forced_k is not None:
        forced = min(forced_k, cap)
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
        if not any(allocate([candidate] * batch, _at_batch(steps, batch))):
            return float(batch)
    return float("inf")


def _at_batch(steps: StepCosts, batch: int) -> Callable[[int], float | None]:
    return lambda rows: steps.seconds(batch, rows)
