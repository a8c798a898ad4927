"""Speculation stays lossless under the logits processors: grammar masks, penalties,
logit_bias and min_tokens (engine.speculation.logits_processors).

Greedy: speculative output (draft, n-gram) equals plain output token for token. Sampling:
the first two tokens follow the exact processed target distribution (Pearson's chi-square
as in test_engine_sampling), for the draft and for n-gram lookup, and the proposals are
partly rejected, so a wrong rule would show.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from engine.api.grammar_text import checked_grammar
from engine.api.types import (
    CompiledConstraint,
    Constraint,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    SpeculativeChoice,
)
from engine.config import EngineConfig, SpeculativeConfig
from engine.serving.service import Engine
from engine.speculation.logits_processors import LogitsProcessing
from engine.speculation.sampling import probabilities
from tests.engine.test_engine_sampling import SIGNIFICANCE, chi_square_p_value
from tests.tiny_models import build_noisy_copy, build_pair

SAMPLES = 500
SCHEMA = {
    "type": "object",
    # Bounded, so that even a random model's output finishes.
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
GREEDY_SETTINGS = {
    "json schema": {"constraint": Constraint("json_schema", json.dumps(SCHEMA))},
    "json object": {"constraint": Constraint("json_object", "{}")},
    "regex": {"constraint": Constraint("regex", "(def|class) [a-z]+\\(\\)")},
    "penalties": {"presence_penalty": 1.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3},
    "logit_bias": {"logit_bias": ((40, 5.0), (41, -100.0), (60, 3.0))},
    "min_tokens": {"min_tokens": 20},
}
SAMPLED_SETTINGS = {
    "json schema": SamplingParams(
        max_tokens=3, ignore_eos=True, constraint=Constraint("json_schema", '{"type":"string"}')
    ),
    "penalties": SamplingParams(
        # Mild: stronger penalties make the target refuse every repeating n-gram proposal.
        max_tokens=3, ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.3,
        repetition_penalty=1.1,
    ),
    "logit_bias": SamplingParams(
        max_tokens=3, ignore_eos=True, logit_bias=tuple((t, 4.0) for t in range(60, 90))
    ),
}  # fmt: skip
NO_FALLBACK = SpeculativeConfig(
    method="draft", acceptance_threshold=0.0, min_speedup=0.0, prompt_lookup_max=3
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("constraints")
    target, _ = build_pair(root)
    draft = build_noisy_copy(target, root / "noisy", noise=0.5)
    eng = Engine.load(
        EngineConfig(target=target, draft=draft, dtype="float32", speculative=NO_FALLBACK)
    )
    yield eng
    eng.close()


def generate(engine: Engine, prompt: list[int], params: SamplingParams, method: str, k: int):  # type: ignore[no-untyped-def]
    request = GenerationRequest(tuple(prompt), params, SpeculativeChoice(method, k))  # type: ignore[arg-type]
    return engine.generate(request)


PROMPTS = ["def add(a, b):\n", "for i in range(10):\n    print(i", "The quick brown fox"]


def seeded_first_pairs(
    engine: Engine, prompt: list[int], params: SamplingParams, method: str
) -> Counter[tuple[int, int]]:
    """The first two tokens of ``SAMPLES`` seeded speculative draws (k = 2), counted; the
    method's proposals must have been accepted sometimes and rejected sometimes, so both
    paths of the rejection sampler were exercised."""
    counts: Counter[tuple[int, int]] = Counter()
    proposed = accepted = 0
    for seed in range(SAMPLES):
        sampled = SamplingParams(**{**params.__dict__, "seed": seed})
        result = generate(engine, prompt, sampled, method, 2)
        counts[(result.token_ids[0], result.token_ids[1])] += 1
        proposed += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    assert 0 < accepted < proposed, f"{method} proposals all or never accepted"
    return counts


@pytest.mark.parametrize("setting", list(GREEDY_SETTINGS))
def test_greedy_speculation_equals_plain_decoding_under_processors(
    engine: Engine, setting: str
) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, **GREEDY_SETTINGS[setting])  # type: ignore[arg-type]
    greedy_outputs_equal_plain(engine, params, setting)


def greedy_outputs_equal_plain(
    engine: Engine, params: SamplingParams, setting: str
) -> list[tuple[int, ...]]:
    """Each of ``PROMPTS`` decoded greedily with draft and n-gram speculation (k = 1 and 4)
    equals plain decoding, token for token, and the proposals were partly accepted (else
    nothing was tested); the plain outputs."""
    outputs: list[tuple[int, ...]] = []
    proposed = accepted = 0
    for text in PROMPTS:
        prompt = engine.tokenizer.encode(text)
        plain = generate(engine, prompt, params, "none", 1).token_ids
        for method in ("draft", "ngram"):
            for k in (1, 4):
                result = generate(engine, prompt, params, method, k)
                assert result.token_ids == plain, (setting, method, k, text)
                proposed += result.stats.num_draft_tokens
                accepted += result.stats.num_accepted_tokens
        outputs.append(tuple(plain))
    assert 0 < accepted < proposed, "proposals must be partly accepted for this to test anything"
    return outputs


def test_a_json_schema_constraint_gives_json_matching_the_schema(engine: Engine) -> None:
    params = SamplingParams(
        max_tokens=120, temperature=0.0, constraint=Constraint("json_schema", json.dumps(SCHEMA))
    )
    for method in ("none", "draft"):
        result = generate(engine, engine.tokenizer.encode("def add(a, b):\n"), params, method, 4)
        assert result.finish_reason == "stop", result.text
        value = json.loads(result.text)
        assert set(value) == {"name", "age"}
        assert isinstance(value["name"], str) and isinstance(value["age"], int)


def test_a_choice_constraint_answers_one_of_the_choices(engine: Engine) -> None:
    choices = ["positive", "negative", "neutral"]
    for seed in range(5):
        params = SamplingParams(
            max_tokens=20, seed=seed, constraint=Constraint("choice", json.dumps(choices))
        )
        result = generate(engine, engine.tokenizer.encode("The quick"), params, "draft", 3)
        assert result.text in choices


def test_a_schema_that_cannot_compile_is_the_clients_error(engine: Engine) -> None:
    params = SamplingParams(constraint=Constraint("json_schema", '{"type": "no-such-type"}'))
    with pytest.raises(InvalidRequestError):
        engine.submit(GenerationRequest((5, 6, 7), params))


def test_the_engine_runs_the_grammar_compiled_before_submit(engine: Engine) -> None:
    """What request preparation compiled (``Engine.compile_constraint``) is what runs, so a
    constraint is compiled, and refused, once; one compiled from another constraint is not."""
    asked = Constraint("choice", json.dumps(["yes"]))
    other = engine.compile_constraint(Constraint("choice", json.dumps(["no"])))
    handed = CompiledConstraint(asked, other.grammar)
    params = SamplingParams(max_tokens=10, temperature=0.0, constraint=asked)
    prompt = tuple(engine.tokenizer.encode("The quick"))
    assert engine.generate(GenerationRequest(prompt, params, compiled=handed)).text == "no"
    assert engine.generate(GenerationRequest(prompt, params, compiled=other)).text == "yes"
    assert engine.generate(GenerationRequest(prompt, params)).text == "yes"


def test_a_constraint_is_checked_without_a_token_table_for_a_remote_backend() -> None:
    assert checked_grammar(Constraint("regex", "[a-z]+"))
    for bad in (Constraint("regex", "("), Constraint("json_schema", '{"type": "nonsense"}')):
        with pytest.raises(InvalidRequestError):
            checked_grammar(bad)


def test_min_tokens_holds_off_the_end_of_sequence(engine: Engine) -> None:
    eos = engine.tokenizer.eos_token_id
    prompt = engine.tokenizer.encode("def add(a, b):\n")
    bias = ((eos, 100.0),)
    ended = generate(engine, prompt, SamplingParams(30, 0.0, logit_bias=bias), "none", 1)
    assert ended.token_ids == () and ended.finish_reason == "stop"
    held = SamplingParams(30, 0.0, logit_bias=bias, min_tokens=7)
    held = generate(engine, prompt, held, "draft", 4)
    assert len(held.token_ids) == 7 and held.finish_reason == "stop"


def test_penalties_follow_their_definitions() -> None:
    """Hand-computed: presence and frequency subtract per occurrence in the output (path
    tokens included), repetition divides positive and multiplies negative logits of tokens
    seen in prompt or output."""
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    processing = LogitsProcessing(params, [0], 4, frozenset(), torch.device("cpu"))
    processing.commit([1])
    logits = torch.tensor([[2.0, 2.0, -2.0, 1.0], [2.0, 2.0, -2.0, 1.0]])
    out = processing.apply(logits, [[], [1, 2]])
    expected = torch.tensor(
        [[1.0, 1.0 - 0.75, -2.0, 1.0], [1.0, 1.0 - 0.5 - 0.5, -4.0 - 0.75, 1.0]]
    )
    torch.testing.assert_close(out, expected)


def processed_probs(
    engine: Engine, prompt: list[int], params: SamplingParams, path: list[int]
) -> torch.Tensor:
    """The target's processed distribution after ``prompt`` and the output ``path``."""
    constraint = params.constraint
    matcher = None
    if constraint is not None:
        matcher = engine.grammars.matcher(engine.grammars.compile(constraint))
    processing = LogitsProcessing(
        params, prompt, engine.vocab_size, frozenset(), engine.device, matcher
    )
    with torch.inference_mode():
        logits = engine._target.model(torch.tensor([[*prompt, *path]])).logits[0, -1:].float()
    return probabilities(processing.apply(logits, [path]), params)[0]


def exact_pair_distribution(
    engine: Engine, prompt: list[int], params: SamplingParams
) -> dict[tuple[int, int], float]:
    """The processed target distribution of the first two tokens, by brute force."""

    def probs(path: list[int]) -> torch.Tensor:
        return processed_probs(engine, prompt, params, path)

    first = probs([])
    return {
        (t1, t2): float(first[t1] * p2)
        for t1 in (first > 1e-6).nonzero().flatten().tolist()
        for t2, p2 in enumerate(probs([t1]).tolist())
        if p2 > 0
    }


def ngram_prompt(engine: Engine, params: SamplingParams) -> list[int]:
    """A prompt 'a b X a b' whose lookup proposal X the processed target takes only
    sometimes (no constraint here: each row is processed with its own prompt)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        a, b = torch.randint(3, engine.vocab_size, (2,), generator=generator).tolist()
        prompts = [[a, b, x, a, b] for x in range(3, engine.vocab_size)]
        with torch.inference_mode():
            logits = engine._target.model(torch.tensor(prompts)).logits[:, -1].float()
        for row, prompt in enumerate(prompts):
            processing = LogitsProcessing(
                params, prompt, engine.vocab_size, frozenset(), engine.device
            )
            p = probabilities(processing.apply(logits[row : row + 1], [[]]), params)[0]
            if 0.05 < p[prompt[2]] < 0.95:
                return prompt
    raise AssertionError("no prompt with a partly accepted n-gram proposal")


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("setting", list(SAMPLED_SETTINGS))
def test_speculative_sampling_is_exact_under_processors(
    engine: Engine, setting: str, method: str
) -> None:
    params = SAMPLED_SETTINGS[setting]
    # Under the schema the output is a JSON string: repeated quoted text gives n-gram lookup
    # proposals that the grammar allows.
    if params.constraint is not None:
        prompt = engine.tokenizer.encode('"def add" "def add" "def add" "def')
    elif method == "draft":
        prompt = engine.tokenizer.encode("def add(a, b):\n")
    else:
        prompt = ngram_prompt(engine, params)
    counts = seeded_first_pairs(engine, prompt, params, method)
    p_value = chi_square_p_value(counts, exact_pair_distribution(engine, prompt, params))
    assert p_value > SIGNIFICANCE
