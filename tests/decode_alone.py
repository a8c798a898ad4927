"""One request decoded alone through the engine's own step (``engine.serving.step.run_step``) on a
``SerialRunner``, its proposal lengths chosen as the scheduler chooses them for a batch of one
(``engine.speculation.batch_speculation``): for tests that drive a runner they built or
perturbed."""

from __future__ import annotations

import torch

from engine.api.types import GenerationStats, SamplingParams
from engine.models.model_runner import ModelRunner
from engine.models.serial_runner import SerialRunner
from engine.serving.step import StepRow, run_step
from engine.speculation.adaptive import SpeculationLength
from engine.speculation.batch_speculation import BatchSpeculation, Sequence, StepCosts
from engine.speculation.logits_processors import LogitsProcessing
from engine.speculation.proposers import NgramProposer
from engine.speculation.proposers.base import Proposal
from engine.speculation.request import Speculation


def decode_alone(
    runner: ModelRunner,
    prompt: list[int],
    params: SamplingParams,
    generator: torch.Generator,
    stats: GenerationStats,
    speculation: Speculation | None = None,
    processing: LogitsProcessing | None = None,
) -> list[int]:
    """The tokens the request commits, ``params.max_tokens`` of them (no stop rules)."""
    proposer = speculation.proposer if speculation is not None else None
    wants_hidden = proposer is not None and proposer.wants_hidden
    prompt_hidden = runner.prefill(prompt, want_hidden=wants_hidden)
    context = list(prompt)
    chooser = None
    if speculation is not None and proposer is not None:
        chooser = BatchSpeculation(StepCosts(speculation.length.costs))
        speculation.begin(context)
        if wants_hidden and prompt_hidden is not None:
            proposer.observe_hidden(prompt_hidden)
    serial = SerialRunner(runner)
    out: list[int] = []
    while len(out) < params.max_tokens:
        proposal = Proposal([])
        remaining = params.max_tokens - len(out)
        if chooser is not None and speculation is not None and proposer is not None:
            (k,) = chooser.lengths([Sequence(speculation, stats.num_target_passes, remaining)])
            if k > 0:
                proposal = proposer.propose(
                    context, k, params, generator, speculation.min_confidence, processing
                )
        row = StepRow(
            0, context, proposal, params, generator, processing,
            observe_hidden=proposer.observe_hidden if wants_hidden and proposer else None,
        )
        (verdict,) = run_step(serial, [row])
        new_tokens = [*(proposal.tokens[i] for i in verdict.path), verdict.next_token]
        context.extend(new_tokens)
        stats.record_step(len(proposal.tokens), len(verdict.path))
        stats.proposal_lengths.append(len(proposal.tokens))
        if speculation is not None:
            speculation.committed(context, len(proposal.tokens), verdict.path)
        out += new_tokens
    return out



def k_alone(speculation: Speculation, chooser: BatchSpeculation | None = None) -> int:
    """The k the scheduler gives the next step of a request served alone (``chooser``: the
    scheduler's chooser, kept from step to step; by default a fresh one)."""
    chooser = chooser or BatchSpeculation(StepCosts(speculation.length.costs))
    (k,) = chooser.lengths([Sequence(speculation, 0, 1 << 20)])
    return k


def adaptive(length: SpeculationLength) -> Speculation:
    """A request with an adaptive k of ``length`` (its proposer: an n-gram lookup)."""
    return Speculation(NgramProposer(1, 3), None, length)
