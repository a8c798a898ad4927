"""The decode loop: propose, verify in one target pass, keep the agreed prefix, roll back.

Plain decoding is the same loop with nothing proposed, so every method shares one code path
and one KV-cache discipline: the target cache holds the committed sequence minus its last
token, which is fed together with the proposal in the next pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from engine.adaptive import PassCosts, SpeculationLength
from engine.logits_processors import LogitsProcessing, chain_paths
from engine.model_runner import ModelRunner
from engine.proposers.base import Proposal, Proposer
from engine.sampling import Verdict, probabilities, verify_greedy, verify_sampled
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


def prefill(target: ModelRunner, prompt: list[int]) -> None:
    """Cache the prompt minus its last token; the first decode pass feeds that token."""
    target.reset()
    if len(prompt) > 1:
        target.forward(prompt[:-1], last_only=True)


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
) -> Generator[list[int], None, None]:
    """Yield the tokens committed by each target pass until ``params.max_tokens`` are out.

    The caller stops early (EOS, stop strings) simply by not asking for more. ``processing``
    (penalties, bias, grammar) shapes the target's rows before verification and the draft's
    before it draws; ``observe`` gets the processed target logits of each committed
    position with the tokens committed there (for logprobs).
    """
    context = list(prompt)
    if speculation is not None:
        speculation.proposer.start(context)
    remaining = params.max_tokens
    while remaining > 0:
        proposal = Proposal([])
        step = stats.num_target_passes
        k = min(speculation.next_k(step), remaining - 1) if speculation is not None else 0
        if speculation is not None and k > 0:
            started = time.perf_counter()
            proposal = speculation.proposer.propose(
                context, k, params, generator, speculation.min_confidence, processing
            )
            if costs is not None and proposal.tokens:
                costs.record_proposer(
                    speculation.proposer.method,
                    (time.perf_counter() - started) / len(proposal.tokens),
                )

        committed = len(context)
        fed = [context[-1], *proposal.tokens]
        started = time.perf_counter()
        logits = target.forward(fed)
        if processing is not None:
            logits = processing.apply(logits, chain_paths(proposal.tokens))
        verdict = _verify(proposal, logits, params, generator)
        if costs is not None:
            costs.record_target(len(fed), time.perf_counter() - started)

        new_tokens = [*proposal.tokens[: verdict.num_accepted], verdict.next_token]
        target.truncate(committed + verdict.num_accepted)
        context.extend(new_tokens)
        if processing is not None:
            processing.commit(new_tokens)
        if observe is not None:
            observe(logits[: len(new_tokens)], new_tokens)
        stats.num_target_passes += 1
        stats.proposal_lengths.append(len(proposal.tokens))
        if proposal.tokens:
            stats.num_drafts += 1
            stats.num_draft_tokens += len(proposal.tokens)
            stats.num_accepted_tokens += verdict.num_accepted
        if speculation is not None:
            speculation.proposer.accepted(context)
            speculation.length.record(len(proposal.tokens), verdict.num_accepted)
        remaining -= len(new_tokens)
        yield new_tokens


def _verify(
    proposal: Proposal, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> Verdict:
    if params.greedy:
        return verify_greedy(proposal.tokens, logits)
    return verify_sampled(proposal.tokens, proposal.probs, probabilities(logits, params), generator)
