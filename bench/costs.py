"""Measured cost of one decoding pass of each model, for the theoretical speedup."""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

from transformers import PreTrainedModel

from engine.model_runner import ModelRunner
from engine.packed_linear import pack_linear_weights


@dataclass(frozen=True)
class PassCosts:
    context_tokens: int
    target_one_ms: float
    target_verify_ms: float  # k + 1 tokens in one pass
    verify_tokens: int
    draft_one_ms: float | None

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
    repeats: int = 25,
) -> PassCosts:
    """Median time of a KV-cached pass after ``context``: target with 1 and k + 1 new tokens,
    draft with 1 new token (the engine's draft proposes one token per pass). Timed on copies
    with their weights packed as the engine serves them (``engine.packed_linear``); the
    models given stay as they are, for Hugging Face's side of a benchmark."""
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
    return PassCosts(len(context), one, verify, k + 1, draft_ms)


def _as_served(model: PreTrainedModel) -> PreTrainedModel:
    served = copy.deepcopy(model)
    pack_linear_weights(served)
    return served
