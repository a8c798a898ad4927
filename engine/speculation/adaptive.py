"""Adaptive speculation: how many tokens to propose, and when to stop proposing at all.

``SpeculationLength`` picks k per step to maximise expected tokens per second, from the
acceptance rate seen so far and the measured cost of draft and target passes.
``FallbackMonitor`` tracks acceptance and the estimated speedup per method over a rolling
window of draft tokens and switches a method off when speculating stops paying, probing now
and then to switch it back on. Every switch is reported as a ``FallbackEvent``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from engine.api.types import FallbackEvent, Method


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per target pass with k proposals at acceptance rate alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def theoretical_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Speedup over plain decoding when one proposal pass costs ``cost_ratio`` target passes."""
    return expected_tokens(alpha, k) / (k * cost_ratio + 1.0)


def pass_cost_speedup(
    drafted: float,
    accepted: float,
    proposing_passes: float,
    passes: float,
    verify_seconds: float,
    proposer_seconds: float,
    plain_seconds: float,
) -> float:
    """Speedup over plain decoding of ``passes`` target passes, ``proposing_passes`` of them
    verifying ``drafted`` proposed tokens of which ``accepted`` were kept (the others ran
    plain), if the passes and the proposer were all the time spent: the tokens committed
    (``accepted + passes``, one from the target per pass) at one plain pass each, over

        proposing_passes * verify_seconds + drafted * proposer_seconds
        + (passes - proposing_passes) * plain_seconds

    Measured acceptance, as it came (in runs or not), not one rate at every position: for
    passes that all propose k with t(k + 1) = t(1) and acceptance independent per position it
    is ``theoretical_speedup``. The engine's fallback judges a method by it, and the
    benchmark's theoretical speedup is it, so what a measured speedup falls short of it is
    time spent outside the passes."""
    seconds = (
        proposing_passes * verify_seconds
        + drafted * proposer_seconds
        + (passes - proposing_passes) * plain_seconds
    )
    tokens = accepted + passes
    return tokens * plain_seconds / seconds if seconds > 0 else float(tokens)


class Ewma:
    """Exponentially weighted mean whose samples are clipped to ``clip`` times the current
    mean: on shared cores one pass descheduled for a second would otherwise make that pass
    size look hundreds of times dearer for many steps (a real slowdown still moves the mean,
    by up to a factor 1 + weight * (clip - 1) per sample)."""

    def __init__(self, weight: float, clip: float = 4.0) -> None:
        self.weight = weight
        self.clip = clip
        self.value: float | None = None

    def update(self, sample: float) -> None:
        if self.value is None:
            self.value = sample
        else:
            sample = min(sample, self.clip * self.value)
            self.value += self.weight * (sample - self.value)


class PassCosts:
    """Measured seconds of a target pass by number of tokens fed, and of one proposer pass.

    Shared by all requests of an engine: calibrated when the engine loads (a request that
    always speculates never runs a one-token pass, so it could not measure that cost itself)
    and refined by every pass served.
    """

    WEIGHT = 0.1

    def __init__(self) -> None:
        self._target: dict[int, Ewma] = {}
        self._proposer: dict[str, Ewma] = {}
        self._proposal: dict[str, Ewma] = {}
        self._catch_up: dict[str, Ewma] = {}
        self._tree_level: dict[str, Ewma] = {}
        self._lock = threading.Lock()

    def record_target(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._target.setdefault(tokens, Ewma(self.WEIGHT)).update(seconds)

    def record_proposer(self, method: str, seconds: float) -> None:
        with self._lock:
            self._proposer.setdefault(method, Ewma(self.WEIGHT)).update(seconds)

    def record_proposal(self, method: str, seconds: float) -> None:
        """One whole proposal of a proposer whose cost does not grow with the tokens it
        proposes (a tree drafted in a few passes: Medusa's heads, EAGLE's levels), so it is
        priced per proposal, not per token."""
        with self._lock:
            self._proposal.setdefault(method, Ewma(self.WEIGHT)).update(seconds)

    def proposal(self, method: str) -> float:
        with self._lock:
            ewma = self._proposal.get(method)
            return ewma.value if ewma is not None and ewma.value is not None else 0.0

    def record_catch_up(self, method: str, rows: int, seconds: float) -> None:
        """A pass that fed a proposer ``rows`` committed tokens it had not seen (a draft
        model's cache catching up after plain steps), without proposing."""
        if rows > 0:
            with self._lock:
                self._catch_up.setdefault(method, Ewma(self.WEIGHT)).update(seconds / rows)

    def record_tree_level(self, method: str, seconds: float) -> None:
        """One draft pass growing a level of a proposer's tree (EAGLE-2)."""
        with self._lock:
            self._tree_level.setdefault(method, Ewma(self.WEIGHT)).update(seconds)

    def tree_level(self, method: str) -> float | None:
        with self._lock:
            ewma = self._tree_level.get(method)
            return None if ewma is None else ewma.value

    def proposer(self, method: str) -> float:
        with self._lock:
            ewma = self._proposer.get(method)
            return ewma.value if ewma is not None and ewma.value is not None else 0.0

    def catch_up(self, method: str, rows: int) -> float:
        """Seconds for the proposer to catch up ``rows`` tokens in one pass: as measured per
        row, or before any such pass, its one-token pass scaled by what ``rows`` tokens cost
        the target against one (the same architecture's shape)."""
        if rows <= 0:
            return 0.0
        with self._lock:
            ewma = self._catch_up.get(method)
            per_row = ewma.value if ewma is not None else None
        if per_row is not None:
            return rows * per_row
        one, many = self.target(1), self.target(rows)
        if not one or many is None:
            return rows * self.proposer(method)
        return self.proposer(method) * many / one

    def target(self, tokens: int) -> float | None:
        """Seconds for a pass of ``tokens``, interpolated between measured sizes, and never
        more than ``tokens`` one-token passes (one pass over n tokens does at most their
        work: a larger figure is a stall on a shared machine, not the pass's cost)."""
        with self._lock:
            known = sorted((n, e.value) for n, e in self._target.items() if e.value is not None)
        if not known:
            return None
        estimate = self._interpolate(known, tokens)
        if known[0][0] == 1:
            estimate = min(estimate, tokens * known[0][1])
        return estimate

    @staticmethod
    def _interpolate(known: list[tuple[int, float]], tokens: int) -> float:
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


def window_speedup(
    costs: PassCosts,
    method: str,
    drafted: int,
    accepted: int,
    proposing_passes: int,
    passes: int,
) -> tuple[float, float] | None:
    """One proposed token's cost in plain target passes, and the estimated speedup over plain
    decoding (``pass_cost_speedup``) of requests that proposed ``drafted`` tokens with the
    method in ``proposing_passes`` of their ``passes`` target passes and kept ``accepted``,
    at the measured pass costs: verifying at the mean k, proposing at the method's cost per
    token. None before a target pass has a cost or without a proposing pass."""
    plain = costs.target(1)
    if not proposing_passes or not plain:
        return None
    per_token = costs.proposer(method)
    mean_k = drafted / proposing_passes
    verify = costs.target(max(2, round(mean_k) + 1)) or plain
    speedup = pass_cost_speedup(
        drafted, accepted, proposing_passes, passes, verify, per_token, plain
    )
    return per_token / plain, speedup


def shrunk_chain(
    events: Sequence[float], trials: Sequence[float], prior: float, weight: float
) -> list[float]:
    """Per position, ``events / trials`` shrunk toward the estimate of the position before
    (``prior`` for the first) as if ``weight`` trials had shown it: positions without data
    carry the estimate before them."""
    estimates: list[float] = []
    estimate = prior
    for seen, tried in zip(events, trials, strict=True):
        estimate = (seen + weight * estimate) / (tried + weight)
        estimates.append(estimate)
    return estimates


def hint_bucket(hint: int) -> int:
    """A proposer's hint (``RunHinting.expected_run``, at least 1) by powers of two: 1, 2-3,
    4-7, 8-15, 16-31, 32 and more. On the demo target's greedy replies to the built-in prompts
    (``python -m bench.ngram_hints``: 3,125 positions of chat, code, editing and JSON) n-gram
    lookup's first proposed token is right at 23 % of the positions whose copy so far is one
    token long, 51 % at 2-3, 79 % at 4-7, 88 % at 8-15 and 98-99 % from 16 on."""
    return min(hint.bit_length(), 6)


class RunLengths:
    """How long a proposer stays right, as Kaplan-Meier counts of accepted runs.

    Per position m: the steps that proposed beyond m and accepted at least m ("at risk"), and
    those among them whose run of accepted tokens stopped exactly at m. A step that accepted
    all it proposed is censored: it says nothing about later positions. With ``decay`` below 1
    older steps weigh less, so an engine-wide history follows a changing workload.

    The steps of a proposer that hints how long it will stay right (``RunHinting``) are also
    counted by their hint's bucket (``hint_bucket``): where a copy has gone on for twenty
    tokens the next one is nearly always right, where it is one token long it mostly is not,
    and one curve for both priced every sequence of a batch by their mixture.
    """

    def __init__(self, max_k: int, decay: float = 1.0) -> None:
        self.max_k = max_k
        self.decay = decay
        self.at_risk = [0.0] * max_k
        self.stopped = [0.0] * max_k
        self.longest = 0  # the longest run of accepted tokens any step has shown
        self.by_hint: dict[int, RunLengths] = {}  # the same counts, per hint bucket

    def record(self, proposed: int, accepted: int, hint: int | None = None) -> None:
        if proposed == 0:
            # A plain step says nothing about the proposer: it must not age the evidence (a
            # batch that ran plain for a while forgot its method's curve and speculated again
            # on the prior alone).
            return
        if self.decay < 1.0:
            self.at_risk = [n * self.decay for n in self.at_risk]
            self.stopped = [n * self.decay for n in self.stopped]
        self.longest = max(self.longest, accepted)
        for m in range(min(accepted + 1, proposed, self.max_k)):
            self.at_risk[m] += 1
        if accepted < proposed and accepted < self.max_k:
            self.stopped[accepted] += 1
        if hint:
            bucket = hint_bucket(hint)
            if bucket not in self.by_hint:
                self.by_hint[bucket] = RunLengths(self.max_k, self.decay)
            self.by_hint[bucket].record(proposed, accepted)

    def hazards(self, prior: float, weight: float, hint: int | None = None) -> list[float]:
        """P(the run stops at m | it reached m) per position, shrunk toward a prior as if
        ``weight`` steps had shown it: ``prior`` for the first position, and for each later
        one the estimate before it (so positions without data carry it). With a ``hint``:
        its bucket's counts, the first position shrunk toward all the counts' estimate."""
        pooled = shrunk_chain(self.stopped, self.at_risk, prior, weight)
        runs = self.by_hint.get(hint_bucket(hint)) if hint else None
        if runs is None:
            return pooled
        return shrunk_chain(runs.stopped, runs.at_risk, pooled[0], weight)

    def scaled_to(self, steps: float) -> RunLengths:
        """A copy whose counts weigh at most ``steps`` steps, with the same shape (each hint
        bucket's too: a bucket seen rarely keeps what it has)."""
        copy = RunLengths(self.max_k)
        copy.longest = self.longest
        scale = min(1.0, steps / self.at_risk[0]) if self.at_risk[0] else 0.0
        copy.at_risk = [n * scale for n in self.at_risk]
        copy.stopped = [n * scale for n in self.stopped]
        copy.by_hint = {bucket: runs.scaled_to(steps) for bucket, runs in self.by_hint.items()}
        return copy


class NodeHits:
    """How often each node of a tree proposal is on the accepted path, by its index in the
    proposal (a static tree's node order, a dynamic tree's rank).

    A tree's k first nodes are its proposal of length k, and (greedily) whether a node is
    accepted depends on its own path only, not on the nodes after it; so the expected tokens
    of a k-node proposal is 1 + the sum of the first k nodes' rates. A chain's accepted run,
    which ``RunLengths`` models, says little here: the first node of a wide tree is one of
    several guesses at the first position, and a run of four accepted tokens in a 16-node
    tree needs 16 nodes, not five.
    """

    def __init__(self, max_k: int, decay: float = 1.0) -> None:
        self.max_k = max_k
        self.decay = decay
        self.proposed = [0.0] * max_k
        self.hits = [0.0] * max_k

    def record(self, proposed: int, path: Sequence[int]) -> None:
        if proposed == 0:
            return
        if self.decay < 1.0:
            self.proposed = [n * self.decay for n in self.proposed]
            self.hits = [n * self.decay for n in self.hits]
        for i in range(min(proposed, self.max_k)):
            self.proposed[i] += 1
        for i in path:
            if i < self.max_k:
                self.hits[i] += 1

    def rates(self, prior: float, weight: float) -> list[float]:
        """Each node's acceptance shrunk toward a prior as if ``weight`` proposals had shown
        it: ``prior`` for the first node, and for each later one the estimate before it (a
        node never proposed yet is taken to be as good as the one before it, so growing the
        tree explores, at the cost of a row)."""
        return shrunk_chain(self.hits, self.proposed, prior, weight)

    def scaled_to(self, steps: float) -> NodeHits:
        """A copy whose counts weigh at most ``steps`` proposals, with the same shape."""
        copy = NodeHits(self.max_k)
        scale = min(1.0, steps / self.proposed[0]) if self.proposed[0] else 0.0
        copy.proposed = [n * scale for n in self.proposed]
        copy.hits = [n * scale for n in self.hits]
        return copy


@dataclass(frozen=True)
class Candidate:
    """One sequence's part in choosing how many tokens a step proposes."""

    # What the j-th proposed token adds to the tokens expected: for a chain S(j) = P(the first
    # j proposals are all accepted), for a tree the j-th node's acceptance (``NodeHits``).
    survival: list[float]
    proposer_seconds: float  # per proposed token
    cap: int  # the most it may propose in this step
    forced: int | None = None  # proposes exactly this many (a fixed k, a replayed schedule)
    # Seconds its proposer spends once before it can propose again (a draft model catching
    # up on what it skipped during plain steps), shared out over the ``tokens_left`` it may
    # still commit.
    resume_seconds: float = 0.0
    tokens_left: int = 1
    proposal_seconds: float = 0.0  # per proposal, whatever its length (``record_proposal``)

    @property
    def chooses(self) -> bool:
        """Whether its length is chosen: not fixed, and it may propose at all."""
        return self.forced is None and self.cap > 0

    def proposes(self, k: int) -> int:
        return self.forced if self.forced is not None else min(k, self.cap)

    def expected(self, k: int) -> float:
        """Expected tokens this step commits for the sequence when it proposes ``k``."""
        return 1.0 + sum(self.survival[:k])

    def overhead(self, k: int) -> float:
        """Proposer seconds this step when it proposes ``k``: ``k`` proposal tokens, and the
        share of a pending catch-up that falls to one of the steps it has left (about
        ``tokens_left`` over the expected tokens per step)."""
        proposed = self.proposes(k)
        if proposed <= 0:
            return 0.0
        resume = self.resume_seconds * self.expected(proposed) / max(self.tokens_left, 1)
        return proposed * self.proposer_seconds + self.proposal_seconds + resume


def best_length(
    candidates: list[Candidate],
    pass_seconds: Callable[[int], float | None],
    incumbent: int | None = None,
    margin: float = 0.0,
) -> int:
    """The proposal length k that maximises the expected tokens per second of one pass over
    ``candidates`` (each feeds its last token and ``proposes(k)`` nodes; ``pass_seconds(r)``
    is the pass's cost at r rows in all), plus the proposers' time; 0 means plain steps pay
    best: one request's adaptive k, or one k for a batch of alike sequences (a batch of
    different ones: ``engine.speculation.batch_speculation.allocate``).

    ``incumbent`` (the k chosen last) is kept unless another k is more than ``margin``
    better: the rates rest on timings of a shared machine, and a choice that flips with
    every noisy sample pays for both (a draft that resumes must first catch up)."""
    if not candidates:
        return 0
    floor = max((c.forced for c in candidates if c.forced is not None), default=0)
    widest = max([floor, *(c.cap for c in candidates if c.forced is None)])
    fed = len(candidates)  # rows before any proposal
    plain = pass_seconds(sum(c.proposes(floor) for c in candidates) + fed)
    if plain is None:
        return widest  # nothing measured yet: every pass costs the same
    rates: dict[int, float] = {}
    for k in range(floor, widest + 1):
        proposed = [c.proposes(k) for c in candidates]
        tokens = sum(c.expected(n) for c, n in zip(candidates, proposed, strict=True))
        seconds = (pass_seconds(sum(proposed) + fed) or plain) + sum(
            c.overhead(k) for c in candidates
        )
        rates[k] = tokens / seconds if seconds > 0 else float("inf")
    best_k = max(rates, key=lambda k: (rates[k], -k))
    if incumbent is not None:
        kept = min(max(incumbent, floor), widest)
        if rates[kept] * (1.0 + margin) >= rates[best_k]:
            return kept
    return best_k


class SpeculationLength:
    """What a request's choice of k needs: how long its proposer stays right and what passes
    cost (the choice itself is the batch's, ``engine.speculation.batch_speculation``, alone a batch
    of one).

    Acceptance is bursty (a draft is right for long runs where the text is predictable, an
    n-gram lookup while the output copies the prompt), so instead of one per-token rate this
    keeps the survival curve S(j) = P(the first j proposals are accepted), from this request's
    steps shrunk toward the engine-wide curve of the method (``history``, shared by all
    requests, so a short request does not start from nothing). Expected tokens per pass with k
    proposals is 1 + S(1) + ... + S(k); k maximises that over (k * proposer pass + target pass
    of k + 1 tokens). k = 0, a plain step, wins when no proposal length pays for itself. After a
    step that accepted all it proposed, the next one proposes at least one token more:
    otherwise a long run would be censored at the current k and never be seen. After
    ``PROBE_AFTER_PLAIN_STEPS`` plain steps in a row one step proposes a token anyway, so a
    pessimistic start (one early rejection) cannot keep k at 0 for good.
    """

    PRIOR_STEPS = 4.0  # weight of the method's rolling acceptance rate
    HISTORY_STEPS = 8.0  # most weight the engine-wide curve gets in a request's curve
    # After this many plain steps in a row, one step proposes a token anyway: without new
    # evidence a pessimistic curve would choose k = 0 for ever.
    PROBE_AFTER_PLAIN_STEPS = 8

    def __init__(
        self,
        max_k: int,
        prior_alpha: float,
        costs: PassCosts,
        method: str,
        history: RunLengths | NodeHits | None = None,
        trees: bool = False,
    ) -> None:
        """``history``: the method's engine-wide counts; a ``NodeHits`` one (or ``trees``
        without one) models a tree proposer, priced per proposal (``PassCosts.proposal``)."""
        self.max_k = max_k
        self.prior_alpha = prior_alpha
        self.costs = costs
        self.method = method
        self.history = history
        self.runs: RunLengths | NodeHits
        if history is not None:
            self.runs = history.scaled_to(self.HISTORY_STEPS)
        else:
            self.runs = NodeHits(max_k) if trees else RunLengths(max_k)
        self.explore_from = 0  # after a fully accepted step: its k
        # How far the proposer expects to be right from the committed sequence (``RunHinting``:
        # n-gram lookup's copy so far; 0 where it has nothing to propose), None from a
        # proposer that gives no hint. It picks the counts the survival curve comes from and
        # is evidence for the reach beside the runs seen.
        self.hint: int | None = None
        # Plain steps chosen in a row (in a batch: beside sequences that speculate).
        self.plain_run = 0
        self.plain_steps = 0  # plain steps chosen in all (probes not counted)
        # The last survival curve, by the counts it came from (steps that proposed, recorded
        # so far) and the hint's bucket: a batch asks for every sequence's curve at every step,
        # and it changes only with a proposal's outcome or the bucket.
        self._proposals = 0
        self._curve: tuple[tuple[int, int | None], list[float]] | None = None

    def record(self, proposed: int, accepted: int, path: Sequence[int] | None = None) -> None:
        """A step that proposed ``proposed`` nodes and accepted ``accepted`` of them: the
        node indices ``path`` (default: a chain's first ``accepted``)."""
        for counts in (self.runs, self.history):
            if isinstance(counts, NodeHits):
                counts.record(proposed, range(accepted) if path is None else path)
            elif counts is not None:
                counts.record(proposed, accepted, self.hint)
        self.explore_from = proposed if proposed and accepted == proposed else 0
        self._proposals += proposed > 0

    def survival(self) -> list[float]:
        """S(1) .. S(max_k) at the proposer's current hint; for a tree, each node's acceptance
        (``NodeHits.rates``)."""
        key = (self._proposals, hint_bucket(self.hint) if self.hint else None)
        if self._curve is not None and self._curve[0] == key:
            return self._curve[1]
        if isinstance(self.runs, NodeHits):
            curve = self.runs.rates(self.prior_alpha, self.PRIOR_STEPS)
        else:
            alive, curve = 1.0, []
            for hazard in self.runs.hazards(1.0 - self.prior_alpha, self.PRIOR_STEPS, self.hint):
                alive *= 1.0 - hazard
                curve.append(alive)
        self._curve = (key, curve)
        return curve

    def candidate(self, cap: int | None = None) -> Candidate:
        """This request as a ``best_length`` candidate proposing at most ``cap``, and at most
        one token beyond the longest run the method has ever had accepted (``reach``); none
        where the proposer's hint says it has nothing to propose."""
        if self.hint == 0:
            return Candidate([], 0.0, 0)
        limit = min(self.reach, self.max_k if cap is None else min(cap, self.max_k))
        return Candidate(
            self.survival(), self.costs.proposer(self.method), limit,
            proposal_seconds=self.costs.proposal(self.method),
        )

    @property
    def reach(self) -> int:
        """How far a proposal may look: one token beyond the longest accepted run seen (this
        request's and the method's engine-wide). Beyond it the survival curve is the prior's
        alone, and on two CPU cores, where a pass's rows cost little each, a prior of one
        half made a method's first steps propose 16 tokens on text where it is rarely right;
        the reach grows one token per fully accepted step (``explore_from``) as runs show.
        A tree's nodes are not a run: its unseen nodes take the estimate of the node before
        (``NodeHits.rates``), so it may propose every node. A proposer that can tell how long
        it expects to stay right (``hint``: n-gram lookup's copy in progress) lets the
        reach start there: an answer quoting a paragraph would otherwise need a step per token
        of reach to propose the rest of it."""
        if isinstance(self.runs, NodeHits):
            return self.max_k
        return max(self.runs.longest + 1, self.hint or 0)


@dataclass(frozen=True)
class WindowFigures:
    """What a method's rolling window shows: acceptance, and whether speculating paid."""

    acceptance_rate: float
    draft_tokens: int
    cost_ratio: float | None  # one proposed token's cost in plain target passes
    speedup: float | None  # estimated speedup over plain decoding; None before costs exist


class FallbackMonitor:
    """Rolling figures per method; switches a method off when speculating does not pay, and
    back on when probes show it pays again.

    A method is switched off once its window of ``window_tokens`` draft tokens shows an
    estimated speedup below ``min_speedup``, or an acceptance rate below the method's own
    threshold where it has one (``thresholds``: by default only model-based proposers, whose
    proposals cost time, keep the seed's 60 % rule; n-gram lookup costs next to nothing, so a
    low acceptance of long proposals can still pay). The speedup comes from the measured
    acceptance, the mean k and the pass costs, over all the passes of the window's requests
    (those that verified a proposal, and plain ones where nothing was proposed):
    ``pass_cost_speedup``. Per-step overheads outside the passes are not in it.

    Adaptive k can also stop proposing by itself (k = 0 pays best); a method whose requests
    mostly ran plain is reported too (``idle``), so that it is visible beside the switched
    off ones, and k = 0 steps still probe (``SpeculationLength``).

    Thread-safe: requests record from the engine's worker, the gateway reads the state.
    """

    # The rolling acceptance handed to adaptive k as its prior is shrunk toward this
    # neutral rate with the weight of this many draft tokens, so one rejected token does
    # not make the prior 0.
    NEUTRAL_ALPHA = 0.5
    PRIOR_TOKENS = 16.0
    # A request of at least IDLE_MIN_STEPS passes whose adaptive k chose plain steps for at
    # least IDLE_SHARE of them marks the method idle; one below half of that clears it.
    IDLE_MIN_STEPS = 16
    IDLE_SHARE = 0.75
    # The speedup estimate rests on timings, which a busy machine disturbs now and then: it
    # must stay below the margin for this many window evaluations in a row (acceptance,
    # a count, decides at once).
    SPEEDUP_EVALUATIONS = 2

    def __init__(
        self,
        model: str,
        thresholds: Mapping[Method, float | None],
        min_speedup: float,
        window_tokens: int,
        probe_interval: int,
        costs: PassCosts,
        listener: Callable[[FallbackEvent], None] | None,
    ) -> None:
        self.model = model
        self.thresholds = dict(thresholds)
        self.min_speedup = min_speedup
        self.window_tokens = window_tokens
        self.probe_interval = probe_interval
        self.costs = costs
        self.listener = listener
        self._lock = threading.Lock()
        # Per method, per request: (draft tokens, accepted, passes with a proposal, all passes).
        self._windows: dict[Method, deque[tuple[int, int, int, int]]] = {}
        self._disabled: dict[Method, int] = {}  # method -> requests seen while switched off
        self._idle: set[Method] = set()
        self._slow: dict[Method, int] = {}  # evaluations in a row with the speedup too low

    def _window(self, method: Method) -> deque[tuple[int, int, int, int]]:
        return self._windows.setdefault(method, deque())

    def threshold(self, method: Method) -> float | None:
        return self.thresholds.get(method)

    def rate(self, method: Method) -> tuple[float, int]:
        """Acceptance rate and number of draft tokens in the method's window."""
        with self._lock:
            figures = self._figures(method)
        return figures.acceptance_rate, figures.draft_tokens

    def prior(self, method: Method) -> float:
        """The window's acceptance shrunk toward ``NEUTRAL_ALPHA``: adaptive k's prior."""
        with self._lock:
            window = self._window(method)
            proposed = sum(entry[0] for entry in window)
            accepted = sum(entry[1] for entry in window)
        return (accepted + self.PRIOR_TOKENS * self.NEUTRAL_ALPHA) / (proposed + self.PRIOR_TOKENS)

    def figures(self, method: Method) -> WindowFigures:
        with self._lock:
            return self._figures(method)

    def _figures(self, method: Method) -> WindowFigures:
        window = self._window(method)
        proposed = sum(entry[0] for entry in window)
        accepted = sum(entry[1] for entry in window)
        passes = sum(entry[2] for entry in window)
        steps = sum(entry[3] for entry in window)
        rate = accepted / proposed if proposed else 1.0
        estimate = window_speedup(self.costs, method, proposed, accepted, passes, steps)
        if estimate is None:
            return WindowFigures(rate, proposed, None, None)
        cost_ratio, speedup = estimate
        return WindowFigures(rate, proposed, cost_ratio, speedup)

    def _pays(self, method: Method, figures: WindowFigures) -> tuple[bool, str]:
        """Whether the window says speculating pays, and the rule that decided."""
        threshold = self.threshold(method)
        if threshold is not None and figures.acceptance_rate < threshold:
            return False, f"acceptance rate {figures.acceptance_rate:.3f} below {threshold:.3f}"
        speedup = figures.speedup
        if self.min_speedup > 0 and speedup is not None and speedup < self.min_speedup:
            self._slow[method] = self._slow.get(method, 0) + 1
            if self._slow[method] >= self.SPEEDUP_EVALUATIONS or method in self._disabled:
                return False, f"estimated speedup {speedup:.2f}x below {self.min_speedup:.2f}x"
            return True, "estimated speedup below the margin once (not yet long enough)"
        self._slow.pop(method, None)
        return True, "acceptance and estimated speedup meet their thresholds"

    def is_disabled(self, method: Method) -> bool:
        with self._lock:
            return method in self._disabled

    def disabled_methods(self) -> set[Method]:
        with self._lock:
            return set(self._disabled)

    def idle_methods(self) -> set[Method]:
        """Methods whose adaptive k has lately chosen plain steps nearly always."""
        with self._lock:
            return set(self._idle)

    def admit(self, method: Method) -> bool:
        """Whether a new request may speculate with ``method``; every Nth one probes."""
        with self._lock:
            if method not in self._disabled:
                return True
            self._disabled[method] += 1
            return self._disabled[method] % self.probe_interval == 0

    def record(
        self,
        method: Method,
        proposed: int,
        accepted: int,
        passes: int = 0,
        steps: int = 0,
        plain_steps: int = 0,
    ) -> None:
        """One request's figures: draft tokens, accepted ones, target passes that verified a
        proposal (``passes``), all target passes (``steps``; 0: only ``passes``) and those
        adaptive k chose to run plain (``plain_steps``; 0 with a fixed k)."""
        events = []
        with self._lock:
            idle_event = self._record_idle(method, steps, plain_steps)
            if idle_event is not None:
                events.append(idle_event)
            if proposed:
                passes = max(passes, 1)
                switch = self._record_window(method, proposed, accepted, passes, max(steps, passes))
                if switch is not None:
                    events.append(switch)
        if self.listener is not None:
            for event in events:
                self.listener(event)

    def _record_window(
        self, method: Method, proposed: int, accepted: int, passes: int, steps: int
    ) -> FallbackEvent | None:
        window = self._window(method)
        window.append((proposed, accepted, passes, steps))
        total = sum(entry[0] for entry in window)
        while window and total - window[0][0] >= self.window_tokens:
            total -= window.popleft()[0]
        figures = self._figures(method)
        if figures.draft_tokens < self.window_tokens:
            return None
        pays, why = self._pays(method, figures)
        if method not in self._disabled and not pays:
            self._disabled[method] = 0
            self._slow.pop(method, None)
            window.clear()
            return self._event(method, "disabled", figures, why)
        if method in self._disabled and pays:
            del self._disabled[method]
            return self._event(method, "enabled", figures, why)
        return None

    def _record_idle(self, method: Method, steps: int, plain_steps: int) -> FallbackEvent | None:
        if steps < self.IDLE_MIN_STEPS:
            return None
        share = plain_steps / steps
        figures = self._figures(method)
        why = (
            f"adaptive k chose plain steps for {plain_steps} of {steps} passes; k = 0 still probes"
        )
        if method not in self._idle and share >= self.IDLE_SHARE:
            self._idle.add(method)
            return self._event(method, "disabled", figures, why)
        if method in self._idle and share < self.IDLE_SHARE / 2:
            self._idle.discard(method)
            return self._event(method, "enabled", figures, why)
        return None

    def _event(
        self, method: Method, action: str, figures: WindowFigures, why: str
    ) -> FallbackEvent:
        reason = f"{why} (over the last {figures.draft_tokens} draft tokens)"
        return FallbackEvent(
            method=method,
            model=self.model,
            action="disabled" if action == "disabled" else "enabled",
            reason=reason,
            acceptance_rate=figures.acceptance_rate,
            window_tokens=figures.draft_tokens,
            threshold=self.threshold(method),
            cost_ratio=figures.cost_ratio,
            speedup_estimate=figures.speedup,
            min_speedup=self.min_speedup,
        )
