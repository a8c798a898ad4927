"""A draft with another tokenizer (universal assisted decoding): its text is re-tokenized
into the target's ids and proposed as a deterministic guess, so every method stays exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.api.types import (
    GenerationRequest,
    IncompatibleDraftError,
    SamplingParams,
    SpeculativeChoice,
)
from engine.config import EngineConfig, SpeculativeConfig
from engine.serving.service import Engine
from engine.speculation.proposers.translating import translate
from engine.training.demo.tokenizer import train_tokenizer
from tests.tiny_models import SAMPLE_TEXT, build_model, build_tokenizer

TEXT = "def add(a, b):\n    return a + b\nfor i in range(10):\n    print(i * i)\n"


def test_translation_continues_the_committed_tokens() -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    cut = len(ids) // 2
    continuation = tokenizer.decode(ids[cut:])
    assert translate(tokenizer, ids[cut - 4 : cut], continuation, 100) == ids[cut:-1]
    assert translate(tokenizer, ids[cut - 4 : cut], continuation, 3) == ids[cut : cut + 3]
    # A tail that does not re-encode to itself (split where the tokenizer would not split):
    split = [*tokenizer.encode("re", add_special_tokens=False),
             *tokenizer.encode("turn", add_special_tokens=False)]
    assert tokenizer.encode("return", add_special_tokens=False) != split
    assert translate(tokenizer, split, " a", 4) == []


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("translating")
    target = build_model(root / "target", build_tokenizer(), seed=0)
    other = train_tokenizer([text[::-1] for text in SAMPLE_TEXT] + SAMPLE_TEXT, vocab_size=290)
    draft = build_model(root / "draft", other, seed=1, hidden=32, layers=1)
    return target, draft


def test_a_draft_with_another_tokenizer_is_refused_unless_translation_is_on(
    models: tuple[Path, Path],
) -> None:
    with pytest.raises(IncompatibleDraftError):
        Engine.load(EngineConfig(target=models[0], draft=models[1], dtype="float32"))


def test_translated_proposals_keep_every_method_exact(models: tuple[Path, Path]) -> None:
    spec = SpeculativeConfig(acceptance_threshold=0.0, min_speedup=0.0)
    engine = Engine.load(EngineConfig(target=models[0], draft=models[1], dtype="float32",
                                      speculative=spec, translate_draft_tokens=True))
    try:
        prompt = engine.tokenizer.encode(TEXT * 2)

        def run(method: str, k: int | None, **sampling: object) -> tuple[list[int], int]:
            params = SamplingParams(max_tokens=24, ignore_eos=True, **sampling)  # type: ignore[arg-type]
            choice = SpeculativeChoice(method, k)  # type: ignore[arg-type]
            result = engine.generate(GenerationRequest(tuple(prompt), params, choice))
            return list(result.token_ids), result.stats.num_draft_tokens

        plain, _ = run("none", None, temperature=0.0)
        tokens, proposed = run("draft", 4, temperature=0.0)
        assert tokens == plain and proposed > 0
        first = run("draft", 4, temperature=1.0, seed=5)
        assert first == run("draft", 4, temperature=1.0, seed=5) and first[1] > 0
    finally:
        engine.close()
