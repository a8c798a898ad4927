"""Greedy speculation is token-identical to plain decoding (float32, property-based)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig, SpeculativeConfig
from engine.serving.service import Engine
from tests.tiny_models import build_noisy_copy, build_pair

# Acceptance threshold 0: these tests check exactness, so fallback must never kick in. With
# adaptive k the draft also stops where it is unsure, so that path is checked too.
NO_FALLBACK = SpeculativeConfig(
    method="draft",
    acceptance_threshold=0.0,
    min_speedup=0.0,
    prompt_lookup_max=3,
    draft_confidence_threshold=0.1,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("greedy")
    target, random_draft = build_pair(root)
    close_draft = build_noisy_copy(target, root / "close", noise=0.3)
    return target, random_draft, close_draft


@pytest.fixture(scope="module", params=["random_draft", "close_draft"])
def engine(request: pytest.FixtureRequest, models: tuple[Path, Path, Path]) -> Iterator[Engine]:
    target, random_draft, close_draft = models
    draft = random_draft if request.param == "random_draft" else close_draft
    eng = Engine.load(
        EngineConfig(target=target, draft=draft, dtype="float32", speculative=NO_FALLBACK)
    )
    yield eng
    eng.close()


def run(
    engine: Engine, prompt: list[int], method: str, k: int | None, **sampling: object
) -> tuple[int, ...]:
    params = SamplingParams(temperature=0.0, **sampling)  # type: ignore[arg-type]
    request = GenerationRequest(tuple(prompt), params, SpeculativeChoice(method, k))  # type: ignore[arg-type]
    return engine.generate(request).token_ids


def test_plain_decoding_matches_transformers_generate(
    engine: Engine, models: tuple[Path, Path, Path]
) -> None:
    model = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
    prompt = engine.tokenizer.encode("def add(a, b):\n")
    expected = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=30,
        do_sample=False,
        min_new_tokens=30,
        pad_token_id=engine.tokenizer.pad_token_id,
    )[0, len(prompt) :].tolist()
    assert list(run(engine, prompt, "none", None, max_tokens=30, ignore_eos=True)) == expected


prompts = st.lists(st.integers(min_value=3, max_value=319), min_size=1, max_size=40)
repetitive = st.lists(st.integers(min_value=3, max_value=40), min_size=2, max_size=6).flatmap(
    lambda unit: st.integers(min_value=2, max_value=6).map(lambda n: unit * n)
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompt=st.one_of(prompts, repetitive),
    method=st.sampled_from(["ngram", "draft"]),
    k=st.one_of(st.none(), st.integers(min_value=1, max_value=8)),
    max_tokens=st.integers(min_value=1, max_value=48),
)
def test_speculative_greedy_equals_plain(
    engine: Engine, prompt: list[int], method: str, k: int | None, max_tokens: int
) -> None:
    plain = run(engine, prompt, "none", None, max_tokens=max_tokens, ignore_eos=True)
    spec = run(engine, prompt, method, k, max_tokens=max_tokens, ignore_eos=True)
    assert spec == plain
    assert len(spec) == max_tokens


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompt=prompts,
    method=st.sampled_from(["ngram", "draft"]),
    k=st.integers(min_value=1, max_value=6),
    stop_at=st.integers(min_value=0, max_value=20),
    use_string=st.booleans(),
)
def test_speculative_greedy_stops_where_plain_stops(
    engine: Engine, prompt: list[int], method: str, k: int, stop_at: int, use_string: bool
) -> None:
    reference = engine.generate(
        GenerationRequest(
            tuple(prompt), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        )
    )
    sampling: dict[str, object] = {"max_tokens": 24, "ignore_eos": True}
    if use_string:
        # A two-character stop string taken from the reference output, so it must occur.
        text = reference.text
        start = stop_at % max(1, len(text) - 1)
        stop_text = text[start : start + 2]
        if len(stop_text) < 2 or "\ufffd" in stop_text:
            return
        sampling["stop"] = (stop_text,)
    else:
        sampling["stop_token_ids"] = (reference.token_ids[stop_at],)
    params = SamplingParams(temperature=0.0, **sampling)  # type: ignore[arg-type]
    plain = engine.generate(GenerationRequest(tuple(prompt), params))
    spec = engine.generate(GenerationRequest(tuple(prompt), params, SpeculativeChoice(method, k)))  # type: ignore[arg-type]
    assert (spec.token_ids, spec.text, spec.finish_reason) == (
        plain.token_ids,
        plain.text,
        plain.finish_reason,
    )
    assert plain.finish_reason == "stop"
    for stop in params.stop:
        assert stop not in plain.text


def test_stop_string_completed_inside_a_multi_token_step_keeps_only_tokens_up_to_it(
    engine: Engine,
) -> None:
    """Found by hypothesis: a step committing the stop string's last token plus one more
    must drop the extra token from the output ids, not only from the text."""
    prompt = (94, 225, 50, 93, 8)
    reference = engine.generate(
        GenerationRequest(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    )
    for end in range(2, len(reference.text)):
        stop = reference.text[end - 2 : end]
        if "\ufffd" in stop:
            continue
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
        plain = engine.generate(GenerationRequest(prompt, params))
        for k in (1, 2, 3):
            spec = engine.generate(GenerationRequest(prompt, params, SpeculativeChoice("ngram", k)))
            assert (spec.token_ids, spec.text) == (plain.token_ids, plain.text)
