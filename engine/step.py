"""One decode step over a batch: every sequence feeds its last committed token plus its
proposal (a tree; a chain is a one-branch tree, plain decoding an empty one), one target pass
runs them all, and each sequence is verified and committed on its own.

Verification is per sequence with the sequence's own generator, in the same order of random
draws as the one-request loop (``engine.decoding``), so a seeded request draws the same
numbers whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.batched_runner import BatchedRunner, Feed
from engine.logits_processors import LogitsProcessing, chain_paths
from engine.proposers.base import Proposal
from engine.sampling import probabilities, verify_greedy, verify_sampled
from engine.tree import chain_parents, path_to
from engine.types import SamplingParams

# Gets the processed target logits of each committed position with the tokens committed
# there (logprobs).
Observer = Callable[[torch.Tensor, list[int]], None]


@dataclass(frozen=True)
class TreeVerdict:
    """Accepted node indices (root child first) and the token after them (engine-interface).
    The tree verifiers of engine.sampling (#18) return the same shape."""

    path: tuple[int, ...]
    next_token: int


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


def proposal_parents(proposal: Proposal) -> tuple[int, ...] | None:
    """The proposal's tree shape; None for a chain (a proposal without ``parents`` is one)."""
    parents: tuple[int, ...] | None = getattr(proposal, "parents", None)
    if parents is not None and tuple(parents) == chain_parents(len(proposal.tokens)):
        return None
    return parents


def row_paths(proposal: Proposal) -> list[list[int]]:
    """Each fed row's context after the committed tokens: none for row 0, the tokens from the
    root down to node i (itself included) for row i + 1."""
    parents = proposal_parents(proposal)
    if parents is None:
        return chain_paths(proposal.tokens)
    tokens = proposal.tokens
    return [[], *([tokens[j] for j in path_to(parents, i)] for i in range(len(tokens)))]


def verify(
    proposal: Proposal, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> TreeVerdict:
    """The accepted path of ``proposal`` against the target's logits ``[n + 1, vocab]``."""
    parents = proposal_parents(proposal)
    if parents is None:
        if params.greedy:
            verdict = verify_greedy(proposal.tokens, logits)
        else:
            target_probs = probabilities(logits, params)
            verdict = verify_sampled(proposal.tokens, proposal.probs, target_probs, generator)
        return TreeVerdict(tuple(range(verdict.num_accepted)), verdict.next_token)
    if not params.greedy:
        raise ValueError(
            "sampled verification of a branching tree needs engine.sampling's tree verifier"
        )
    return _verify_tree_greedy(proposal.tokens, parents, logits)


def _verify_tree_greedy(
    tokens: list[int], parents: tuple[int, ...], logits: torch.Tensor
) -> TreeVerdict:
    """Walk down from row 0 along the target's argmax while a child carries it."""
    best = logits.argmax(dim=-1).tolist()
    path: list[int] = []
    row = 0  # row of the current node (0 = the last committed token)
    while True:
        parent = path[-1] if path else -1
        child = next(
            (i for i, p in enumerate(parents) if p == parent and tokens[i] == best[row]), None
        )
        if child is None:
            return TreeVerdict(tuple(path), best[row])
        path.append(child)
        row = child + 1


def run_step(runner: BatchedRunner, rows: list[StepRow]) -> list[TreeVerdict]:
    """One target pass over ``rows``; verify and commit each; the verdicts in row order."""
    feeds = [
        Feed(row.slot, [row.context[-1], *row.proposal.tokens], proposal_parents(row.proposal))
        for row in rows
    ]
    logits = runner.forward(feeds)
    verdicts = []
    for row, row_logits in zip(rows, logits, strict=True):
        if row.processing is not None:
            row_logits = row.processing.apply(row_logits, row_paths(row.proposal))
        verdict = verify(row.proposal, row_logits, row.params, row.generator)
        runner.keep_path(row.slot, len(row.context), verdict.path)
        new_tokens = [*(row.proposal.tokens[i] for i in verdict.path), verdict.next_token]
        if row.processing is not None:
            row.processing.commit(new_tokens)
        if row.observe is not None:
            row.observe(row_logits[[0, *(i + 1 for i in verdict.path)]], new_tokens)
        verdicts.append(verdict)
    return verdicts
