"""One decode step over a batch: every sequence feeds its last committed token plus its
proposal (a tree; a chain is a one-branch tree, plain decoding an empty one), one target pass
runs them all, and each sequence is verified and committed on its own.

Verification is per sequence with the sequence's own generator, so a seeded request draws
the same numbers whatever else shares the batch. A request served alone is a batch of one
through this same step; a model whose cache slots cannot share a pass runs it on a
``SerialRunner`` (one sequence at a time in Hugging Face's cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.api.types import SamplingParams
from engine.models.batched_runner import Feed
from engine.speculation.logits_processors import LogitsProcessing, proposal_paths
from engine.speculation.proposers.base import Proposal
from engine.speculation.request import verify
from engine.speculation.sampling import TreeVerdict

# Gets the processed target logits of each committed position with the tokens committed
# there (logprobs).
Observer = Callable[[torch.Tensor, list[int]], None]


class StepRunner(Protocol):
    """The target's runner as the scheduler and the step use it: ``BatchedRunner`` (slots
    that share each pass) or ``SerialRunner`` (one slot in Hugging Face's cache)."""

    device: torch.device

    def forward(self, feeds: list[Feed], last_only: bool = False) -> list[torch.Tensor]: ...

    def forward_hidden(
        self, feeds: list[Feed]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...

    def keep_path(
        self, slot: int, committed_len: int, path: tuple[int, ...] | list[int]
    ) -> None: ...

    def move_slot(self, source: int, target: int) -> None: ...

    def release(self, slot: int) -> None: ...

    def reserve(self, slot: int, positions: int) -> None: ...


@dataclass
class StepRow:
    """One sequence's part of a step."""

    slot: int
    context: list[int]  # the committed tokens; the cache holds all but the last
    proposal: Proposal
    params: SamplingParams
    generator: torch.Generator
    processing: LogitsProcessing | None = None
    observe: Observer | None = None
    # Gets the target's last hidden states of the committed positions (a proposer that
    # drafts from them).
    observe_hidden: Callable[[torch.Tensor], None] | None = None


def proposal_parents(proposal: Proposal) -> tuple[int, ...] | None:
    """The proposal's tree shape; None for a chain."""
    return None if proposal.is_chain else proposal.parent_indices()


def run_step(runner: StepRunner, rows: list[StepRow]) -> list[TreeVerdict]:
    """One target pass over ``rows``; verify and commit each; the verdicts in row order."""
    feeds = [
        Feed(row.slot, [row.context[-1], *row.proposal.tokens], proposal_parents(row.proposal))
        for row in rows
    ]
    hidden: list[torch.Tensor | None] = [None] * len(rows)
    if any(row.observe_hidden is not None for row in rows):
        logits, states = runner.forward_hidden(feeds)
        hidden = list(states)
    else:
        logits = runner.forward(feeds)
    verdicts = []
    for row, row_logits, row_hidden in zip(rows, logits, hidden, strict=True):
        if row.processing is not None:
            row_logits = row.processing.apply(
                row_logits, proposal_paths(row.proposal.tokens, proposal_parents(row.proposal))
            )
        verdict = verify(row.proposal, row_logits, row.params, row.generator)
        runner.keep_path(row.slot, len(row.context), verdict.path)
        new_tokens = [*(row.proposal.tokens[i] for i in verdict.path), verdict.next_token]
        if row.processing is not None:
            row.processing.commit(new_tokens)
        if row.observe is not None:
            row.observe(row_logits[[0, *(i + 1 for i in verdict.path)]], new_tokens)
        if row.observe_hidden is not None and row_hidden is not None:
            row.observe_hidden(row_hidden[[0, *(i + 1 for i in verdict.path)]])
        verdicts.append(verdict)
    return verdicts
