"""Greedy speculation in bfloat16: every divergence from plain decoding is a near-tie within
the dtype's rounding, and a verification that is off by more is flagged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedModel

from engine.api.types import GenerationRequest, GenerationStats, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig, SpeculativeConfig
from engine.models.loading import load_model
from engine.models.model_runner import ModelRunner
from engine.serving.service import Engine
from engine.speculation.adaptive import PassCosts, SpeculationLength
from engine.speculation.divergence import (
    ROUNDING_ULPS,
    first_difference,
    first_divergence,
    rounding_bound,
    ulp,
)
from engine.speculation.proposers.ngram import NgramProposer
from engine.speculation.request import Speculation
from tests.decode_alone import decode_alone
from tests.tiny_models import build_noisy_copy, build_pair

NO_FALLBACK = SpeculativeConfig(
    method="draft", acceptance_threshold=0.0, min_speedup=0.0, prompt_lookup_max=3,
    draft_confidence_threshold=0.1,
)
MAX_TOKENS = 24


def test_ulp_and_bound_follow_the_dtype() -> None:
    assert ulp(1.0, torch.bfloat16) == 2.0**-7
    assert ulp(-10.0, torch.bfloat16) == 2.0**-4
    assert ulp(10.0, torch.float32) == 2.0**-20
    assert ulp(0.75, torch.float16) == 2.0**-11
    assert rounding_bound(10.0, torch.bfloat16) == ROUNDING_ULPS * 2.0**-4


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 2]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([4], [5, 6]) == 0


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("divergence")
    target, _ = build_pair(root)
    return target, build_noisy_copy(target, root / "close", noise=0.3)


@pytest.fixture(scope="module")
def bf16_engine(models: tuple[Path, Path]) -> Iterator[Engine]:
    target, draft = models
    engine = Engine.load(
        EngineConfig(target=target, draft=draft, dtype="bfloat16", speculative=NO_FALLBACK)
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def bf16_target(models: tuple[Path, Path]) -> PreTrainedModel:
    model = load_model(models[0], torch.device("cpu"), "bfloat16")
    assert model.dtype == torch.bfloat16
    return model


def _generate(engine: Engine, prompt: list[int], method: str, k: int | None) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    request = GenerationRequest(tuple(prompt), params, SpeculativeChoice(method, k))  # type: ignore[arg-type]
    return list(engine.generate(request).token_ids)


prompts = st.one_of(
    st.lists(st.integers(min_value=3, max_value=319), min_size=1, max_size=40),
    st.lists(st.integers(min_value=3, max_value=40), min_size=2, max_size=6).flatmap(
        lambda unit: st.integers(min_value=2, max_value=6).map(lambda n: unit * n)
    ),
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(prompt=prompts, method=st.sampled_from(["ngram", "draft"]), k=st.sampled_from([None, 3]))
def test_bf16_greedy_divergences_are_near_ties_within_rounding(
    bf16_engine: Engine, bf16_target: PreTrainedModel, prompt: list[int], method: str,
    k: int | None,
) -> None:
    plain = _generate(bf16_engine, prompt, "none", None)
    speculative = _generate(bf16_engine, prompt, method, k)
    divergence = first_divergence(bf16_target, prompt, plain, speculative, (k or 4) + 1)
    if divergence is None:
        assert speculative == plain
        return
    assert divergence.dtype == "bfloat16"
    assert divergence.plain_gap >= 0.0
    assert divergence.within_rounding, divergence


class PerturbedVerification(ModelRunner):
    """A broken target runner: in every pass of several tokens its first row's logit of the
    target's least likely token is raised above the maximum (far beyond any rounding)."""

    def forward(
        self, token_ids: list[int], last_only: bool = False, **tree: Any
    ) -> torch.Tensor:
        logits = super().forward(token_ids, last_only, **tree).clone()
        if len(token_ids) > 1 and not last_only:
            row = logits[0]
            row[row.argmin()] = row.max() + 1.0
        return logits


def _decode(runner: ModelRunner, prompt: list[int], speculate: bool) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    speculation = (
        Speculation(NgramProposer(1, 3), 3, SpeculationLength(3, 0.5, PassCosts(), "ngram"))
        if speculate
        else None
    )
    return decode_alone(
        runner, prompt, params, torch.Generator(), GenerationStats("ngram"), speculation
    )


@pytest.mark.parametrize("unit", [[5, 9, 13], [7, 7, 30, 12], [21, 4]])
def test_a_verification_off_beyond_rounding_is_flagged(
    bf16_target: PreTrainedModel, unit: list[int]
) -> None:
    prompt = unit * 4
    plain = _decode(ModelRunner(bf16_target), prompt, speculate=False)
    honest = _decode(ModelRunner(bf16_target), prompt, speculate=True)
    broken = _decode(PerturbedVerification(bf16_target), prompt, speculate=True)
    assert broken != plain
    divergence = first_divergence(bf16_target, prompt, plain, broken, 4)
    assert divergence is not None
    assert divergence.plain_gap > divergence.bound
    assert not divergence.within_rounding
    honest_divergence = first_divergence(bf16_target, prompt, plain, honest, 4)
    assert honest_divergence is None or honest_divergence.within_rounding


class RoundingNoise(ModelRunner):
    """A target runner whose passes of several tokens round differently from one-token steps:
    every logit moves by up to half ``ROUNDING_ULPS`` ulps at its magnitude, so a gap between
    two logits by up to the bound. (The tiny models' bfloat16 passes happen to agree bit for
    bit; real models' do not.)"""

    def __init__(self, model: PreTrainedModel, seed: int) -> None:
        super().__init__(model)
        self.noise = torch.Generator().manual_seed(seed)

    def forward(
        self, token_ids: list[int], last_only: bool = False, **tree: Any
    ) -> torch.Tensor:
        logits = super().forward(token_ids, last_only, **tree).clone()
        if len(token_ids) > 1 and not last_only:
            magnitude = logits.abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
            eps = torch.finfo(torch.bfloat16).eps
            spacing = eps * torch.exp2(torch.floor(torch.log2(magnitude)))
            uniform = torch.rand(logits.shape, generator=self.noise) * 2.0 - 1.0
            logits += uniform * spacing * (ROUNDING_ULPS / 2.0)
        return logits


def test_divergences_from_rounding_noise_are_found_at_near_ties(
    bf16_target: PreTrainedModel,
) -> None:
    found = []
    for seed in range(12):
        generator = torch.Generator().manual_seed(seed)
        unit = torch.randint(3, 300, (int(torch.randint(2, 5, (1,), generator=generator)),),
                             generator=generator).tolist()
        prompt = unit * 3
        plain = _decode(ModelRunner(bf16_target), prompt, speculate=False)
        noisy = _decode(RoundingNoise(bf16_target, seed), prompt, speculate=True)
        divergence = first_divergence(bf16_target, prompt, plain, noisy, 4)
        if divergence is not None:
            found.append(divergence)
    assert len(found) >= 3, "too few divergences: the test would exercise little"
    assert all(0.0 <= d.plain_gap <= d.bound for d in found), found
    assert all(d.within_rounding for d in found)
