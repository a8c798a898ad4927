"""vLLM's sampling extensions stay lossless under speculation: ``min_p``,
``allowed_token_ids`` and ``bad_words``; and the output options ``include_stop_str_in_output``
and ``skip_special_tokens``.

Greedy: speculative output (draft, n-gram; k 1 and 4) equals plain output token for token.
Sampling: the first two tokens follow the exact filtered target distribution, computed here
from the target's raw logits by an independent reference of each rule (not the engine's own
``probabilities``), under Pearson's chi-square at significance 0.001 with 500 seeded draws
(test_engine_sampling's binning). Power: the same draws must be rejected (p < 0.001) against
the unfiltered distribution, so a filter left out on either side would fail the test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.api.types import SamplingParams
from engine.config import EngineConfig
from engine.serving.output import OutputAssembler
from engine.serving.service import Engine
from engine.speculation.logits_processors import LogitsProcessing
from tests.engine.test_engine_constraints import (
    NO_FALLBACK,
    greedy_outputs_equal_plain,
    seeded_first_pairs,
)
from tests.engine.test_engine_sampling import SIGNIFICANCE, chi_square_p_value
from tests.tiny_models import build_noisy_copy, build_pair

MIN_P = 0.2
ALLOWED = tuple(range(40, 90))
GREEDY_SETTINGS: dict[str, dict[str, object]] = {
    "min_p": {"min_p": MIN_P},
    "allowed_token_ids": {"allowed_token_ids": ALLOWED},
    "bad_words": {"bad_words": ((40,), (41, 42), (60, 61, 62))},
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("vllm-sampling")
    target, _ = build_pair(root)
    draft = build_noisy_copy(target, root / "noisy", noise=0.5)
    eng = Engine.load(
        EngineConfig(target=target, draft=draft, dtype="float32", speculative=NO_FALLBACK)
    )
    yield eng
    eng.close()


@pytest.mark.parametrize("setting", list(GREEDY_SETTINGS))
def test_greedy_speculation_equals_plain_decoding(engine: Engine, setting: str) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, **GREEDY_SETTINGS[setting])  # type: ignore[arg-type]
    for plain in greedy_outputs_equal_plain(engine, params, setting):
        if setting == "allowed_token_ids":
            assert set(plain) <= set(ALLOWED)


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The filtered distribution by definition: tokens outside ``allowed_token_ids`` get
    nothing; after temperature, tokens below ``min_p`` x the top probability get nothing."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.allowed_token_ids:
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[list(params.allowed_token_ids)] = True
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    if params.min_p > 0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
        probs = probs / probs.sum()
    return probs.float()


def pair_distribution(
    engine: Engine, prompt: list[int], params: SamplingParams
) -> dict[tuple[int, int], float]:
    def probs(path: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = engine._target.model(torch.tensor([[*prompt, *path]])).logits[0, -1]
        return reference_probs(logits, params)

    first = probs([])
    return {
        (t1, t2): float(first[t1] * p2)
        for t1 in (first > 1e-6).nonzero().flatten().tolist()
        for t2, p2 in enumerate(probs([t1]).tolist())
        if p2 > 0
    }


def ngram_prompt(engine: Engine, params: SamplingParams) -> list[int]:
    """A prompt 'a b X a b' whose lookup proposal X the filtered target takes sometimes."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        a, b = torch.randint(40, 90, (2,), generator=generator).tolist()
        prompts = [[a, b, x, a, b] for x in range(40, 90)]
        with torch.inference_mode():
            logits = engine._target.model(torch.tensor(prompts)).logits[:, -1]
        for row, prompt in enumerate(prompts):
            if 0.05 < reference_probs(logits[row], params)[prompt[2]] < 0.95:
                return prompt
    raise AssertionError("no prompt with a partly accepted n-gram proposal")


SAMPLED_SETTINGS = {
    "min_p": SamplingParams(max_tokens=2, ignore_eos=True, min_p=MIN_P),
    "min_p, temperature 1.5": SamplingParams(
        max_tokens=2, ignore_eos=True, temperature=1.5, min_p=MIN_P
    ),
    "allowed_token_ids": SamplingParams(max_tokens=2, ignore_eos=True, allowed_token_ids=ALLOWED),
}


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("setting", list(SAMPLED_SETTINGS))
def test_speculative_sampling_is_exact(engine: Engine, setting: str, method: str) -> None:
    params = SAMPLED_SETTINGS[setting]
    if method == "draft":
        prompt = engine.tokenizer.encode("def add(a, b):\n")
    else:
        prompt = ngram_prompt(engine, params)
    counts = seeded_first_pairs(engine, prompt, params, method)
    assert chi_square_p_value(counts, pair_distribution(engine, prompt, params)) > SIGNIFICANCE
    unfiltered = SamplingParams(temperature=params.temperature)
    power = chi_square_p_value(counts, pair_distribution(engine, prompt, unfiltered))
    assert power < SIGNIFICANCE, "the unfiltered distribution must be told apart"


def test_bad_words_mask_a_words_last_token_only_after_the_rest() -> None:
    params = SamplingParams(bad_words=((1,), (2, 3)))
    processing = LogitsProcessing(params, [0], 5, frozenset(), torch.device("cpu"))
    processing.commit([2])
    out = processing.apply(torch.zeros(3, 5), [[], [0], [3, 2]])
    inf = float("-inf")
    expected = torch.tensor(
        [[0.0, inf, 0.0, inf, 0.0], [0.0, inf, 0.0, 0.0, 0.0], [0.0, inf, 0.0, inf, 0.0]]
    )
    torch.testing.assert_close(out, expected)


def test_allowed_token_ids_mask_every_other_token_and_padding() -> None:
    params = SamplingParams(allowed_token_ids=(1, 3))
    processing = LogitsProcessing(params, [0], 4, frozenset(), torch.device("cpu"))
    out = processing.apply(torch.zeros(1, 6), [[]])
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, False, False]


def test_a_row_with_nothing_left_draws_an_end_token() -> None:
    """Never a row of -inf (NaN probabilities, or token 0 by argmax): the end tokens, the
    model's end-of-sequence even under ignore_eos, else the row as it was before the masks."""
    params = SamplingParams(allowed_token_ids=(1,), bad_words=((1,),))
    cpu = torch.device("cpu")
    ending = LogitsProcessing(params, [0], 4, frozenset({3}), cpu).apply(torch.zeros(1, 4), [[]])
    assert torch.isfinite(ending[0]).tolist() == [False, False, False, True]
    ignoring = LogitsProcessing(params, [0], 4, frozenset(), cpu, eos_ids=frozenset({2}))
    assert torch.isfinite(ignoring.apply(torch.zeros(1, 4), [[]])[0]).tolist() == [
        False, False, True, False,
    ]  # fmt: skip
    bare = LogitsProcessing(params, [0], 4, frozenset(), cpu).apply(torch.zeros(1, 4), [[]])
    assert torch.isfinite(bare).all()


def test_stop_strings_and_stop_tokens_are_kept_on_request(engine: Engine) -> None:
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode("x")
    text_ids = tokenizer.encode("abc def ghi")
    stop_id = text_ids[-1]

    def assembled(**options: object) -> tuple[str, int]:
        params = SamplingParams(max_tokens=50, **options)  # type: ignore[arg-type]
        output = OutputAssembler(tokenizer, params, prompt, frozenset())
        piece = output.add(text_ids)
        assert piece.finish_reason == "stop"
        return output.text, len(output.token_ids)

    full = tokenizer.decode(text_ids)
    cut = full.index("def")
    assert assembled(stop=("def",))[0] == full[:cut]
    assert assembled(stop=("def",), include_stop_str_in_output=True)[0] == full[: cut + 3]
    stopped, count = assembled(stop_token_ids=(stop_id,))
    kept, kept_count = assembled(stop_token_ids=(stop_id,), include_stop_str_in_output=True)
    assert count == text_ids.index(stop_id) and len(stopped) < len(full)
    assert kept == full and kept_count == count + 1


def test_special_tokens_are_shown_on_request(engine: Engine) -> None:
    tokenizer = engine.tokenizer
    special = tokenizer.convert_tokens_to_ids(tokenizer.all_special_tokens[0])
    ids = [*tokenizer.encode("abc"), special]
    for skip in (True, False):
        params = SamplingParams(max_tokens=50, skip_special_tokens=skip)
        output = OutputAssembler(tokenizer, params, tokenizer.encode("x"), frozenset())
        output.add(ids)
        assert (tokenizer.all_special_tokens[0] in output.text) is not skip
