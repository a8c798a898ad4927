"""The batch's speculation length from measured acceptance and measured step costs, at one
sequence as in a batch: n-gram lookup on chat text (rarely right) runs plain steps, probes,
and speculates again once its proposals are accepted; a method without evidence proposes one
token and looks further only as far as its runs have been accepted.

The acceptance figures are those measured on the built-in chat prompts with the demo target
(n-gram, k = 4: 15 % of proposals had their first token accepted, 8 % of proposed tokens).
"""

from __future__ import annotations

from engine.adaptive import PassCosts, RunLengths, SpeculationLength
from engine.batch_speculation import BatchSpeculation, Sequence, StepCosts
from engine.decoding import Speculation
from engine.proposers import NgramProposer


def two_core_steps(per_row: float = 0.016, fixed: float = 0.064) -> StepCosts:
    """Steps of one sequence as measured: by default each fed row adds a fifth of a plain
    step (pass, verification and commit)."""
    costs = PassCosts()
    for rows in (1, 2, 4, 8, 16, 17):
        costs.record_target(rows, fixed + per_row * rows)
    costs.record_proposer("ngram", 0.0002)
    steps = StepCosts(costs)
    for width in (1, 2, 3, 5):
        steps.record(1, width, fixed + per_row * width)
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
