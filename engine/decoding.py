"""The decode loop: propose a tree, verify it in one target pass, keep the accepted path.

A chain is a one-branch tree and plain decoding an empty one, so every method shares one
code path and one KV-cache discipline: the target cache holds the committed sequence minus
its last token, which is fed together with the proposal in the next pass. A chain feeds no
positions and no mask (they are the causal defaults), so it costs what it always did.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch

from engine.adaptive import PassCosts, SpeculationLength
from engine.logits_processors import LogitsProcessing, proposal_paths
from engine.model_runner import ModelRunner
from engine.proposers.base import Proposal, Proposer, RunHinting
from engine.sampling import TreeVerdict, probabilities, verify_tree_greedy, verify_tree_sampled
from engine.tree import ancestor_mask, depths
from engine.types import GenerationStats, SamplingParams


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

    def next_k(self, step: int) -> int:
        if self.schedule is not None:
            return self.schedule[step] if step < len(self.schedule) else 0
        return self.fixed_k if self.fixed_k is not None else self.length.choose()

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


def prefill(
    target: ModelRunner, prompt: list[int], want_hidden: bool = False
) -> torch.Tensor | None:
    """Cache the prompt minus its last token; the first decode pass feeds that token. With
    ``want_hidden``, returns the target's last hidden states of those positions."""
    target.reset()
    if len(prompt) < 2:
        return None
    if want_hidden:
        return target.forward_hidden(prompt[:-1])[1]
    target.forward(prompt[:-1], last_only=True)
    return None


def decode(
    target: ModelRunner,
    prompt: list[int],
    params: SamplingParams,
    generator: torch.Generator,
    stats: GenerationStats,
    speculation: Speculation | None = None,
    costs: PassCosts | None = None,
    processing: LogitsProcessing | None = None,
    observe: Callable[[torch.Tensor, list[int]], None] | None = None,
    prompt_hidden: torch.Tensor | None = None,
) -> Generator[list[int], None, None]:
    """Yield the tokens committed by each target pass until ``params.max_tokens`` are out.

    The caller stops early (EOS, stop strings) simply by not asking for more. ``processing``
    (penalties, bias, grammar) shapes the target's rows before verification and the draft's
    before it draws; ``observe`` gets the processed target logits of each committed
    position with the tokens committed there (for logprobs). ``prompt_hidden``: what
    ``prefill(..., want_hidden=True)`` returned, for a proposer that drafts from the target's
    hidden states.
    """
    context = list(prompt)
    proposer = speculation.proposer if speculation is not None else None
    wants_hidden = proposer is not None and getattr(proposer, "wants_hidden", False)
    if speculation is not None and proposer is not None:
        speculation.begin(context)
        if wants_hidden and prompt_hidden is not None:
            proposer.observe_hidden(prompt_hidden)  # type: ignore[attr-defined]
    remaining = params.max_tokens
    while remaining > 0:
        proposal = Proposal([])
        step = stats.num_target_passes
        k = min(speculation.next_k(step), remaining - 1) if speculation is not None else 0
        if speculation is not None and proposer is not None and k > 0:
            started = time.perf_counter()
            proposal = proposer.propose(
                context, k, params, generator, speculation.min_confidence, processing
            )
            if costs is not None and proposal.tokens:
                record_proposal_cost(
                    costs, proposer, time.perf_counter() - started, len(proposal.tokens)
                )

        committed = len(context)
        fed = [context[-1], *proposal.tokens]
        # A chain's pass takes the causal defaults: exactly the call it made before trees.
        tree: dict[str, object] = {}
        if not proposal.is_chain:
            parents = proposal.parent_indices()
            tree["positions"] = [committed - 1 + d for d in (0, *depths(parents))]
            tree["tree_mask"] = ancestor_mask(parents)
        started = time.perf_counter()
        hidden = None
        if wants_hidden:
            logits, hidden = target.forward_hidden(fed, **tree)  # type: ignore[arg-type]
        else:
            logits = target.forward(fed, **tree)  # type: ignore[arg-type]
        if processing is not None:
            logits = processing.apply(logits, proposal_paths(proposal.tokens, proposal.parents))
        verdict = verify(proposal, logits, params, generator)
        if costs is not None:
            costs.record_target(len(fed), time.perf_counter() - started)

        path = list(verdict.path)
        new_tokens = [*(proposal.tokens[i] for i in path), verdict.next_token]
        target.keep_path(committed, path)
        context.extend(new_tokens)
        if processing is not None:
            processing.commit(new_tokens)
        if observe is not None:
            observe(logits[[0, *(i + 1 for i in path)]], new_tokens)
        stats.record_step(len(proposal.tokens), len(path))
        stats.proposal_lengths.append(len(proposal.tokens))
        if proposer is not None and speculation is not None:
            if hidden is not None:
                proposer.observe_hidden(hidden[[0, *(i + 1 for i in path)]])  # type: ignore[attr-defined]
            speculation.committed(context, len(proposal.tokens), path)
        remaining -= len(new_tokens)
        yield new_tokens


def verify(
    proposal: Proposal, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> TreeVerdict:
    """The accepted path of ``proposal`` against the target's processed logits ``[n + 1,
    vocab]``: greedy walks the target's argmax, sampling rejects recursively over siblings."""
    if params.greedy:
        return verify_tree_greedy(proposal, logits)
    return verify_tree_sampled(proposal, probabilities(logits, params), generator)
