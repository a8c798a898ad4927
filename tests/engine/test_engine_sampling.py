"""Speculative sampling draws exactly from the target's distribution.

For each sampling setting we compute the exact joint distribution of the first two output
tokens from the target's logits, draw N seeded speculative samples, and run Pearson's
chi-square test at significance 0.001 (bins with an expected count under 5 are pooled).
Seeds 0..N-1 make each run deterministic. Each case also checks that the proposer really
differs from the target, so that a wrong acceptance rule would be caught.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from scipy.stats import chisquare

from engine.api.types import GenerationRequest, GenerationStats, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig, SpeculativeConfig
from engine.serving.service import Engine
from engine.speculation.adaptive import PassCosts, RunLengths, SpeculationLength
from engine.speculation.proposers.ngram import lookup
from engine.speculation.request import Speculation
from engine.speculation.sampling import probabilities
from tests.decode_alone import decode_alone
from tests.tiny_models import build_noisy_copy, build_pair

SIGNIFICANCE = 0.001
SAMPLES = 600
SETTINGS = {
    "temperature 1": SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True),
    "temperature 0.5": SamplingParams(max_tokens=3, temperature=0.5, ignore_eos=True),
    "top_k 4": SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True),
    "top_p 0.7": SamplingParams(max_tokens=3, temperature=1.0, top_p=0.7, ignore_eos=True),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("sampling")
    target, _ = build_pair(root)
    draft = build_noisy_copy(target, root / "noisy", noise=0.5)
    config = EngineConfig(
        target=target,
        draft=draft,
        dtype="float32",
        speculative=SpeculativeConfig(
            method="draft", acceptance_threshold=0.0, min_speedup=0.0, prompt_lookup_max=3
        ),
    )
    eng = Engine.load(config)
    yield eng
    eng.close()


def next_token_probs(
    model: torch.nn.Module, contexts: list[list[int]], params: SamplingParams
) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor(contexts, device=model.device)).logits[:, -1].float()
    return probabilities(logits, params).cpu()


def exact_pair_distribution(
    engine: Engine, prompt: list[int], params: SamplingParams
) -> dict[tuple[int, int], float]:
    model = engine._target.model
    first = next_token_probs(model, [prompt], params)[0]
    firsts = [t for t in range(len(first)) if first[t] > 1e-6]
    second = next_token_probs(model, [[*prompt, t] for t in firsts], params)
    return {
        (t1, t2): float(first[t1] * second[i, t2])
        for i, t1 in enumerate(firsts)
        for t2 in second[i].nonzero().flatten().tolist()
    }


def ngram_prompt(engine: Engine, params: SamplingParams) -> list[int]:
    """A prompt 'a b c X a b c' whose lookup proposal X the target accepts only sometimes."""
    model = engine._target.model
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        a, b, c = torch.randint(3, engine.vocab_size, (3,), generator=generator).tolist()
        candidates = [[a, b, c, x, a, b, c] for x in range(3, engine.vocab_size)]
        probs = next_token_probs(model, candidates, params)
        for prompt, row in zip(candidates, probs, strict=True):
            if 0.2 < row[prompt[3]] < 0.8:
                assert lookup(prompt, 2, 1, 3)[0] == prompt[3]
                return prompt
    raise AssertionError("no prompt with a partly accepted n-gram proposal")


def chi_square_p_value(
    samples: Counter[tuple[int, int]], exact: dict[tuple[int, int], float]
) -> float:
    """Pearson's test over pairs; rare pairs pool by first token, rare first tokens together."""
    total = sum(samples.values())
    pairs = {pair for pair, p in exact.items() if p * total >= 5}
    by_first: Counter[int] = Counter()
    for (first, second), p in exact.items():
        if (first, second) not in pairs:
            by_first[first] += p * total
    firsts = {first for first, mass in by_first.items() if mass >= 5}

    def bin_of(pair: tuple[int, int]) -> object:
        if pair in pairs:
            return pair
        return pair[0] if pair[0] in firsts else None

    expected: Counter[object] = Counter()
    for pair, p in exact.items():
        expected[bin_of(pair)] += p * total
    observed: Counter[object] = Counter()
    for pair, count in samples.items():
        observed[bin_of(pair)] += count
    keys = sorted((k for k in expected if k is not None), key=lambda k: -expected[k])
    obs = [float(observed[k]) for k in keys]
    exp = [expected[k] for k in keys]
    if expected[None] >= 5:
        obs.append(float(observed[None]))
        exp.append(expected[None])
    else:  # too little mass for a bin of its own: pool it with the smallest bin
        obs[-1] += observed[None]
        exp[-1] += expected[None]
    return float(chisquare(obs, exp, sum_check=False).pvalue)


def draw(
    engine: Engine, prompt: list[int], params: SamplingParams, method: str
) -> Counter[tuple[int, int]]:
    counts: Counter[tuple[int, int]] = Counter()
    for seed in range(SAMPLES):
        request = GenerationRequest(
            tuple(prompt),
            SamplingParams(**{**params.__dict__, "seed": seed}),
            SpeculativeChoice(method, 2),  # type: ignore[arg-type]
        )
        result = engine.generate(request)
        assert result.stats.fallback_active is False
        counts[(result.token_ids[0], result.token_ids[1])] += 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_draft_model_sampling_is_exact(engine: Engine, setting: str) -> None:
    params = SETTINGS[setting]
    prompt = engine.tokenizer.encode("def add(a, b):\n")
    draft_model = engine._proposers["draft"].pool.runner.model  # type: ignore[attr-defined]
    p = next_token_probs(engine._target.model, [prompt], params)[0]
    q = next_token_probs(draft_model, [prompt], params)[0]
    distance = 0.5 * float((p - q).abs().sum())
    assert 0.05 < distance < 0.95, (
        f"draft too close to or too far from the target: TV {distance:.3f}"
    )
    p_value = chi_square_p_value(
        draw(engine, prompt, params, "draft"), exact_pair_distribution(engine, prompt, params)
    )
    assert p_value > SIGNIFICANCE


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_ngram_sampling_is_exact(engine: Engine, setting: str) -> None:
    params = SETTINGS[setting]
    prompt = ngram_prompt(engine, params)
    p_value = chi_square_p_value(
        draw(engine, prompt, params, "ngram"), exact_pair_distribution(engine, prompt, params)
    )
    assert p_value > SIGNIFICANCE


@pytest.mark.slow
def test_draft_sampling_that_stops_where_the_draft_is_unsure_is_exact(engine: Engine) -> None:
    """Adaptive k lets the draft stop after a token it is unsure of; whether it stops depends
    on its own random draws, and the first two tokens must still follow the target exactly."""
    params = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)
    prompt = engine.tokenizer.encode("def add(a, b):\n")
    draft = engine._proposers["draft"]
    q = next_token_probs(draft.pool.runner.model, [prompt], params)[0]  # type: ignore[attr-defined]
    min_confidence = float(q.max()) * 0.9
    counts: Counter[tuple[int, int]] = Counter()
    proposed: Counter[int] = Counter()
    for seed in range(SAMPLES):
        # Nothing measured and a method whose runs have reached 4: the adaptive bound is
        # max_k; the confidence stop shortens it.
        reached = RunLengths(4)
        reached.record(4, 4)
        length = SpeculationLength(4, 0.5, PassCosts(), "draft", reached)
        stats = GenerationStats(method="draft")
        tokens = decode_alone(
            engine._target,
            prompt,
            params,
            torch.Generator().manual_seed(seed),
            stats,
            Speculation(draft, None, length, min_confidence),
        )
        counts[(tokens[0], tokens[1])] += 1
        proposed[stats.num_draft_tokens // max(stats.num_drafts, 1)] += 1
    assert len(proposed) > 1, f"the draft never or always stopped early: {proposed}"
    p_value = chi_square_p_value(counts, exact_pair_distribution(engine, prompt, params))
    assert p_value > SIGNIFICANCE


def test_the_chi_square_check_rejects_the_draft_distribution(engine: Engine) -> None:
    """Power check: samples from the draft alone are told apart from the target."""
    params = SETTINGS["temperature 1"]
    prompt = engine.tokenizer.encode("def add(a, b):\n")
    draft_model = engine._proposers["draft"].pool.runner.model  # type: ignore[attr-defined]
    q = next_token_probs(draft_model, [prompt], params)[0]
    generator = torch.Generator().manual_seed(0)
    firsts = torch.multinomial(q, SAMPLES, replacement=True, generator=generator).tolist()
    q2 = next_token_probs(draft_model, [[*prompt, t] for t in firsts], params)
    seconds = torch.multinomial(q2, 1, generator=generator).flatten().tolist()
    samples = Counter(zip(firsts, seconds, strict=True))
    assert (
        chi_square_p_value(samples, exact_pair_distribution(engine, prompt, params)) < SIGNIFICANCE
    )
