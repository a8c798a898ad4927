"""Measured cost of one decoding pass of each model, for the theoretical speedup."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from engine.api.types import SamplingParams
from engine.models.model_runner import ModelRunner
from engine.models.packed_linear import pack_linear_weights
from engine.speculation.proposers import Proposer


@dataclass(frozen=True)
class PassCosts:
    context_tokens: int
    target_one_ms: float
    target_verify_ms: float  # k + 1 tokens in one pass
    verify_tokens: int
    draft_one_ms: float | None
    # Per method whose proposer drafts from the target's hidden states (Medusa, EAGLE): one
    # proposal of the fixed k, its catch-up on a step's features included.
    proposal_ms: Mapping[str, float] = field(default_factory=dict)

    def proposer_ratio(self, method: str, mean_k: float) -> float | None:
        """One proposed token's cost in one-token target passes: the draft model's ``c``, a
        heads method's measured proposal spread over its ``mean_k`` tokens, 0 for a method
        whose proposals were not timed (n-gram lookup); None when it should have been."""
        if method == "draft":
            return self.draft_cost_ratio
        if method in self.proposal_ms:
            return self.proposal_ms[method] / self.target_one_ms / mean_k if mean_k else 0.0
        return 0.0

    @property
    def draft_cost_ratio(self) -> float | None:
        """``c``: one draft pass in units of one target pass."""
        return None if self.draft_one_ms is None else self.draft_one_ms / self.target_one_ms

    def as_dict(self) -> dict[str, object]:
        return {
            "context_tokens": self.context_tokens,
            "target_one_token_ms": round(self.target_one_ms, 3),
            "target_verify_ms": round(self.target_verify_ms, 3),
            "verify_tokens": self.verify_tokens,
            "draft_one_token_ms": (
                None if self.draft_one_ms is None else round(self.draft_one_ms, 3)
            ),
            "draft_cost_ratio": self.draft_cost_ratio,
            "proposal_ms": {m: round(ms, 3) for m, ms in self.proposal_ms.items()},
        }


def median_costs(samples: list[PassCosts]) -> PassCosts:
    """Field-wise median of measurements taken at different times of a noisy run."""
    drafts = [s.draft_one_ms for s in samples if s.draft_one_ms is not None]
    return PassCosts(
        context_tokens=samples[0].context_tokens,
        target_one_ms=statistics.median(s.target_one_ms for s in samples),
        target_verify_ms=statistics.median(s.target_verify_ms for s in samples),
        verify_tokens=samples[0].verify_tokens,
        draft_one_ms=statistics.median(drafts) if drafts else None,
        proposal_ms={
            method: statistics.median(s.proposal_ms[method] for s in samples)
            for method in samples[0].proposal_ms
        },
    )


def _median_pass_ms(runner: ModelRunner, tokens: list[int], repeats: int) -> float:
    kept = runner.length
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward(tokens, last_only=len(tokens) == 1)
        times.append(time.perf_counter() - start)
        runner.truncate(kept)
    return statistics.median(times) * 1000.0


def measure_pass_costs(
    target: PreTrainedModel, draft: PreTrainedModel | None, context: list[int], k: int,
    repeats: int = 25, proposers: Mapping[str, Callable[[], Proposer]] | None = None,
) -> PassCosts:
    """Median time of a KV-cached pass after ``context``: target with 1 and k + 1 new tokens,
    draft with 1 new token (the engine's draft proposes one token per pass), and a proposal
    of k tokens by each of ``proposers`` that drafts from the target's hidden states
    (``proposal_ms``). Timed on copies with their weights packed as the engine serves them
    (``engine.models.packed_linear``); the models given stay as they are, for Hugging Face's side
    of a benchmark."""
    target = _as_served(target)
    target_runner = ModelRunner(target)
    target_runner.forward(context, last_only=True)
    one = _median_pass_ms(target_runner, context[-1:], repeats)
    verify = _median_pass_ms(target_runner, context[-(k + 1) :], repeats)
    draft_ms = None
    if draft is not None:
        draft_runner = ModelRunner(_as_served(draft))
        draft_runner.forward(context, last_only=True)
        draft_ms = _median_pass_ms(draft_runner, context[-1:], repeats)
    hidden = None
    proposal_ms = {}
    for method, make in (proposers or {}).items():
        proposer = make()
        if not getattr(proposer, "wants_hidden", False):
            continue
        if hidden is None:
            hidden = ModelRunner(target).forward_hidden(context[:-1])[1]
        proposal_ms[method] = _median_proposal_ms(proposer, hidden, context, k, repeats)
    return PassCosts(len(context), one, verify, k + 1, draft_ms, proposal_ms)


def _median_proposal_ms(
    proposer: Proposer, hidden: torch.Tensor, context: list[int], k: int, repeats: int
) -> float:
    """One proposal of ``k`` tokens after ``context`` as a decode step makes it: the proposer
    has seen the target's features up to two positions back and gets the last two (a step
    that accepted one token and added the target's), so its catch-up is timed with it.
    ``hidden``: the target's features of ``context[:-1]``."""
    params = SamplingParams(max_tokens=k + 1, temperature=0.0)
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(repeats):
        proposer.start(context)
        proposer.observe_hidden(hidden[:-2])
        proposer.propose(context[:-2], k, params, generator)
        proposer.accepted(context)
        proposer.observe_hidden(hidden[-2:])
        start = time.perf_counter()
        proposer.propose(context, k, params, generator)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000.0


def _as_served(model: PreTrainedModel) -> PreTrainedModel:
    served = copy.deepcopy(model)
    pack_linear_weights(served)
    return served
