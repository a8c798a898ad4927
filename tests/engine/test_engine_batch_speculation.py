"""The batch's speculation length from measured acceptance and measured step costs, at one
sequence as in a batch: n-gram lookup on chat text (rarely right) runs plain steps, probes,
and speculates again once its proposals are accepted; a method without evidence proposes one
token and looks further only as far as its runs have been accepted.

The acceptance figures are those measured on the built-in chat prompts with the demo target
(n-gram, k = 4: 15 % of proposals had their first token accepted, 8 % of proposed tokens).
"""

from __future__ import annotations

from itertools import pairwise

from engine.speculation.adaptive import PassCosts, RunLengths, SpeculationLength
from engine.speculation.batch_speculation import BatchSpeculation, Sequence, StepCosts
from engine.speculation.proposers import NgramProposer
from engine.speculation.request import Speculation


def two_core_steps(per_row: float = 0.016, fixed: float = 0.064) -> StepCosts:
    """Steps of one sequence as measured: by default each fed row adds a fifth of a plain
    step (pass, verification and commit)."""
    costs = PassCosts()
    for rows in (1, 2, 4, 8, 16, 17):
        costs.record_target(rows, fixed + per_row * rows)
    costs.record_proposer("ngram", 0.0002)
    steps = StepCosts(costs)
    for rows in (1, 2, 3, 5):
        steps.record(1, rows, fixed + per_row * rows)
    return steps


def ngram(steps: StepCosts, history: RunLengths | None = None, prior: float = 0.5) -> Sequence:
    length = SpeculationLength(16, prior, steps.costs, "ngram", history)
    return Sequence(Speculation(NgramProposer(1, 4), None, length), 0, 100)


def chat_history() -> RunLengths:
    """Twenty steps of four proposed tokens: three accepted the first token, one of them two
    (the engine's prior from such a window, ``FallbackMonitor.prior``, is about 0.1)."""
    history = RunLengths(16)
    for accepted in [0] * 17 + [1, 1, 2]:
        history.record(4, accepted)
    return history


def test_ngram_on_chat_runs_plain_steps_at_one_sequence() -> None:
    steps = two_core_steps()
    chooser = BatchSpeculation(steps)
    seq = ngram(steps, chat_history(), prior=0.1)
    assert chooser.lengths([seq]) == [0]
    # A probe whose one token was accepted does not buy a wider step the costs price out.
    assert seq.speculation is not None
    seq.speculation.length.record(1, 1)
    assert chooser.lengths([seq]) == [0]


def test_ngram_speculates_again_once_its_proposals_are_accepted() -> None:
    steps = two_core_steps()
    chooser = BatchSpeculation(steps)
    seq = ngram(steps, chat_history(), prior=0.1)
    assert seq.speculation is not None
    length = seq.speculation.length
    assert chooser.lengths([seq]) == [0]
    for k in range(1, 9):  # the output starts copying the prompt: every proposal accepted
        length.record(k, k)
    assert chooser.lengths([seq])[0] >= 4


def test_a_method_without_evidence_proposes_one_token_and_reaches_further_with_its_runs() -> None:
    steps = two_core_steps(per_row=0.0005)  # rows nearly free: the prior alone says 16
    chooser = BatchSpeculation(steps)
    history = RunLengths(16)
    seq = ngram(steps, history)
    assert seq.speculation is not None
    length = seq.speculation.length
    assert chooser.lengths([seq]) == [1]
    length.record(1, 1)
    assert chooser.lengths([seq]) == [2]
    length.record(2, 2)
    length.record(3, 0)  # rejected at once: the reach stays at one beyond the longest run
    assert length.reach == 3
    # A new request of the method starts from the method's reach, not from one again.
    assert ngram(steps, history).speculation.length.reach == 3  # type: ignore[union-attr]


def test_plain_steps_do_not_age_the_method_history() -> None:
    history = RunLengths(16, decay=0.99)
    for accepted in (2, 0, 1):
        history.record(4, accepted)
    before = (list(history.at_risk), list(history.stopped))
    for _ in range(200):  # a batch that ran plain: no proposal, no evidence
        history.record(0, 0)
    assert (history.at_risk, history.stopped) == before


class NoisySteps(StepCosts):
    """Step costs at which one proposed token and a plain step pay the same, give or take a
    noise of ``wobble`` that the test flips between steps."""

    def __init__(self, costs: PassCosts, plain: float, tie_at_k_1: float) -> None:
        super().__init__(costs)
        self.plain, self.tie, self.wobble = plain, tie_at_k_1, 0.02

    def seconds(self, batch: int, rows: int) -> float | None:
        if rows == batch:
            return self.plain
        if rows == 2 * batch:
            return self.tie * (1.0 + self.wobble)
        return 100.0  # longer steps never pay


def test_the_batch_choice_does_not_flip_with_noise_in_the_step_costs() -> None:
    costs = PassCosts()
    costs.record_proposer("ngram", 0.0)
    history = RunLengths(16)
    for accepted in (0, 1) * 10:  # half the one-token proposals accepted
        history.record(1, accepted)
    seqs = [ngram(StepCosts(costs), history, prior=0.5) for _ in range(2)]
    survival = seqs[0].speculation.length.survival()[0]  # type: ignore[union-attr]
    # Two sequences at k = 1 commit 2 * (1 + S(1)) tokens per step of k = 1: the same rate as
    # plain steps when that step costs (1 + S(1)) plain ones.
    steps = NoisySteps(costs, 0.1, 0.1 * (1.0 + survival))
    chooser = BatchSpeculation(steps)
    choices = []
    for step in range(2 * chooser.PROBE_AFTER_PLAIN_STEPS):  # before any probe is due
        steps.wobble = 0.02 if step % 2 else -0.02
        choices.append(chooser.lengths(seqs))
    switches = sum(1 for a, b in pairwise(choices) if a != b)
    assert switches <= 1, choices


def draft_sequence(costs: PassCosts, history: RunLengths, remaining: int, lag: int) -> Sequence:
    length = SpeculationLength(16, 0.5, costs, "draft", history)
    return Sequence(Speculation(NgramProposer(1, 4), None, length), 0, remaining, lag)


def test_probes_of_a_lagging_draft_spend_a_bounded_share_of_plain_steps() -> None:
    """A batch of four draft sequences that runs plain (the draft is rarely right): its
    draft caches fall behind by a token per step, and a probe must first catch them up
    (before, all four caught up every 33 steps: a fifth of the plain steps' time here)."""
    costs = PassCosts()
    costs.record_proposer("draft", 0.004)
    costs.record_catch_up("draft", 100, 0.1)  # 1 ms per caught-up row
    steps = StepCosts(costs)
    steps.record(4, 4, 0.08)
    steps.record(4, 8, 0.12)
    history = RunLengths(16)
    for accepted in [0] * 19 + [1]:
        history.record(2, accepted)
    chooser = BatchSpeculation(steps)
    lag = [100] * 4  # the prompts, never drafted
    plain_seconds = catch_up_seconds = 0.0
    probes = 0
    for _ in range(2000):
        seqs = [draft_sequence(costs, history, 1000, rows) for rows in lag]
        ks = chooser.lengths(seqs)
        if any(ks):
            assert set(ks) == {0, 1}
            probes += 1
            catch_up_seconds += sum(0.001 * rows for rows, k in zip(lag, ks, strict=True) if k)
        plain_seconds += 0.08
        lag = [0 if k else rows + 1 for rows, k in zip(lag, ks, strict=True)]
    assert probes >= 1  # it still probes
    assert catch_up_seconds <= BatchSpeculation.PROBE_SHARE * plain_seconds


def test_a_draft_that_must_catch_up_resumes_only_where_the_steps_left_repay_it() -> None:
    costs = PassCosts()
    costs.record_proposer("draft", 0.002)
    costs.record_catch_up("draft", 100, 0.1)
    steps = StepCosts(costs)
    steps.record(1, 1, 0.05)
    steps.record(1, 2, 0.055)
    history = RunLengths(16)
    for accepted in [1] * 18 + [0, 0]:  # the draft is right nine times in ten
        history.record(1, accepted)
    # 200 rows to catch up (0.2 s) against steps that save about 0.02 s each.
    near_end = draft_sequence(costs, history, remaining=4, lag=200)
    far_from_it = draft_sequence(costs, history, remaining=200, lag=200)
    assert BatchSpeculation(steps).lengths([near_end]) == [0]
    assert BatchSpeculation(steps).lengths([far_from_it])[0] > 0


def test_a_stalled_step_does_not_move_the_step_cost() -> None:
    steps = StepCosts(PassCosts())
    for _ in range(10):
        steps.record(4, 4, 0.1)
    steps.record(4, 4, 5.0)  # descheduled for five seconds on a shared machine
    assert steps.seconds(4, 4) == 0.1


def test_a_request_that_ended_alone_leaves_the_next_one_a_fresh_choice() -> None:
    """The last step of a request alone can propose nothing (k = 0 by its cap); the margin
    that keeps a running batch's k must not then hold the next request at plain steps."""
    costs = PassCosts()
    costs.record_proposer("ngram", 0.0)
    history = RunLengths(16)
    for accepted in (0, 1) * 10:
        history.record(1, accepted)
    fresh = ngram(StepCosts(costs), history, prior=0.5)
    survival = fresh.speculation.length.survival()[0]  # type: ignore[union-attr]
    # One proposed token pays 3 % better than a plain step: less than the switching margin.
    steps = NoisySteps(costs, 0.1, 0.1 * (1.0 + survival) / 1.03)
    steps.wobble = 0.0
    chooser = BatchSpeculation(steps)
    ending = Sequence(fresh.speculation, 0, 1)  # one token left: it may propose none
    assert chooser.lengths([ending]) == [0]
    assert chooser.lengths([fresh]) == BatchSpeculation(steps).lengths([fresh]) == [1]


def quoting_and_chat_history() -> RunLengths:
    """N-gram lookup's steps as the demo target's replies show them (``hint_bucket``): sixty
    where the copy so far was one token long, all rejected at once, and ten where it was twenty
    tokens long, all eight proposed tokens accepted. Together: one step in seven right."""
    history = RunLengths(16)
    for _ in range(60):
        history.record(4, 0, hint=1)
    for _ in range(10):
        history.record(8, 8, hint=20)
    return history


def test_a_sequence_far_into_a_copy_speculates_beside_seven_that_are_not() -> None:
    # At batch 8 a proposed row costs a third of a plain row (measured: a sequence verifying 4
    # tokens beside 7 plain ones made the step about an eighth dearer).
    steps = two_core_steps(per_row=0.004)
    history = quoting_and_chat_history()
    seqs = [ngram(steps, history, prior=0.2) for _ in range(8)]
    for i, seq in enumerate(seqs):
        assert seq.speculation is not None
        seq.speculation.length.hint = 20 if i == 7 else 1
    chosen = BatchSpeculation(steps).lengths(seqs)
    assert chosen[:7] == [0] * 7 and chosen[7] >= 4, chosen


def test_the_curve_of_a_hint_comes_from_the_steps_with_hints_like_it() -> None:
    history = quoting_and_chat_history()
    length = SpeculationLength(16, 0.2, PassCosts(), "ngram", history)
    length.hint = 20
    far = length.survival()
    length.hint = 1
    near = length.survival()
    length.hint = None  # a proposer without hints: every step alike
    pooled = length.survival()
    assert far[0] > 0.6 and far[7] > 0.5
    assert near[0] < 0.1 < pooled[0] < far[0]


def test_nothing_to_propose_is_neither_a_plain_step_nor_a_probe() -> None:
    steps = two_core_steps()
    seq = ngram(steps, chat_history(), prior=0.1)
    assert seq.speculation is not None
    length = seq.speculation.length
    length.hint = 0  # n-gram lookup found no match
    chooser = BatchSpeculation(steps)
    for _ in range(4 * length.PROBE_AFTER_PLAIN_STEPS):
        assert chooser.lengths([seq]) == [0]
    assert length.plain_steps == 0 and length.candidate().cap == 0
