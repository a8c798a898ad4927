"""How one request speculates (its proposer and proposal lengths), and the verdict of one
target pass over a proposal.

Every request, alone or in a batch, decodes through ``engine.serving.step``: a proposal is a tree (a
chain is a one-branch tree, plain decoding an empty one), verified against one target pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.api.types import SamplingParams
from engine.speculation.adaptive import PassCosts, SpeculationLength
from engine.speculation.proposers.base import Proposal, Proposer, RunHinting
from engine.speculation.sampling import (
    TreeVerdict,
    probabilities,
    verify_tree_greedy,
    verify_tree_sampled,
)


@dataclass
class Speculation:
    """How one request speculates: a proposer and either a fixed k or an adaptive one.

    With ``min_confidence`` above 0 (only ever set with an adaptive k) k is a bound: the
    proposer may stop earlier where it is unsure. A fixed k is proposed whole, as vLLM does.
    """

    proposer: Proposer
    fixed_k: int | None
    length: SpeculationLength
    min_confidence: float = 0.0
    schedule: tuple[int, ...] | None = None  # a recorded k per step (replay), 0 past its end

    def forced_k(self, step: int) -> int | None:
        """The k that a replay's schedule or a fixed k sets for ``step``; None where it is
        chosen adaptively (``engine.speculation.batch_speculation``)."""
        if self.schedule is not None:
            return self.schedule[step] if step < len(self.schedule) else 0
        return self.fixed_k

    def begin(self, context: list[int]) -> None:
        """The request starts decoding after ``context`` (its prompt)."""
        self.proposer.start(context)
        self._hint(context)

    def committed(self, context: list[int], proposed: int, path: Sequence[int]) -> None:
        """A step that proposed ``proposed`` nodes accepted those at ``path``; the committed
        sequence is now ``context``."""
        self.proposer.accepted(context)
        self.length.record(proposed, len(path), path)
        self._hint(context)

    def _hint(self, context: list[int]) -> None:
        if isinstance(self.proposer, RunHinting):
            self.length.hint = self.proposer.expected_run(context)


def record_proposal_cost(costs: PassCosts, proposer: Proposer, seconds: float, tokens: int) -> None:
    """``seconds`` of one proposal of ``tokens`` tokens, per proposal or per token."""
    if proposer.proposes_trees:
        costs.record_proposal(proposer.method, seconds)
    else:
        costs.record_proposer(proposer.method, seconds / tokens)


def verify(
    proposal: Proposal, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> TreeVerdict:
    """The accepted path of ``proposal`` against the target's processed logits ``[n + 1,
    vocab]``: greedy walks the target's argmax, sampling rejects recursively over siblings."""
    if params.greedy:
        return verify_tree_greedy(proposal, logits)
    return verify_tree_sampled(proposal, probabilities(logits, params), generator)
