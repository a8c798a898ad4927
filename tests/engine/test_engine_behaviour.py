"""Engine behaviour: KV rollback, end conditions, seeds, fallback, queue, streaming, loading."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.api.types import (
    MAX_SPECULATIVE_TOKENS,
    FallbackEvent,
    GenerationRequest,
    GenerationResult,
    IncompatibleDraftError,
    InvalidRequestError,
    MethodUnavailableError,
    PromptTooLongError,
    QueueFullError,
    SamplingParams,
    SpeculativeChoice,
)
from engine.config import EngineConfig, SpeculativeConfig, speculative_config_from_vllm
from engine.models.model_runner import ModelRunner
from engine.models.versioning import CACHE_NAME, model_version
from engine.serving.service import Engine
from engine.speculation.adaptive import (
    FallbackMonitor,
    PassCosts,
    RunLengths,
    SpeculationLength,
    expected_tokens,
    theoretical_speedup,
)
from tests.decode_alone import adaptive, k_alone
from tests.tiny_models import build_model, build_noisy_copy, build_pair, build_tokenizer

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("behaviour"))


@pytest.fixture(scope="module")
def engine(pair: tuple[Path, Path]) -> Iterator[Engine]:
    config = EngineConfig(
        target=pair[0],
        draft=pair[1],
        dtype="float32",
        speculative=SpeculativeConfig(method="draft", acceptance_threshold=0.0, min_speedup=0.0),
    )
    eng = Engine.load(config)
    yield eng
    eng.close()


def request(
    prompt: str | list[int],
    engine: Engine,
    params: SamplingParams = GREEDY,
    method: str | None = None,
    k: int | None = None,
) -> GenerationRequest:
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    return GenerationRequest(tuple(ids), params, SpeculativeChoice(method, k))  # type: ignore[arg-type]


def test_truncated_cache_continues_exactly_like_a_fresh_one(pair: tuple[Path, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32)
    runner = ModelRunner(model)
    runner.forward([5, 6, 7, 8])
    runner.forward([9, 10, 11])  # a rejected proposal
    runner.truncate(5)
    assert runner.length == 5
    after_rollback = runner.forward([12, 13])
    fresh = ModelRunner(model)
    expected = fresh.forward([5, 6, 7, 8, 9, 12, 13])[-2:]
    torch.testing.assert_close(after_rollback, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        runner.truncate(99)


def test_max_tokens_ends_with_length(engine: Engine) -> None:
    for method in ("none", "ngram", "draft"):
        result = engine.generate(
            request(
                "x = 1\n",
                engine,
                SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
                method,
                4,
            )
        )
        assert (len(result.token_ids), result.finish_reason) == (7, "length")


def test_eos_ends_generation_at_the_same_token_for_every_method(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    # Make the token that plain greedy decoding emits fourth an end-of-sequence token.
    target = tmp_path / "target"
    shutil.copytree(pair[0], target)
    probe = Engine.load(EngineConfig(target=target, dtype="float32"))
    plain = probe.generate(request("def f():\n", probe))
    probe.close()
    eos = plain.token_ids[3]
    config_file = target / "generation_config.json"
    generation = json.loads(config_file.read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], eos]
    config_file.write_text(json.dumps(generation))
    eng = Engine.load(
        EngineConfig(
            target=target,
            draft=pair[1],
            dtype="float32",
            speculative=SpeculativeConfig(acceptance_threshold=0.0, min_speedup=0.0),
        )
    )
    try:
        for method in ("none", "ngram", "draft"):
            params = SamplingParams(max_tokens=24, temperature=0.0)
            result = eng.generate(request("def f():\n", eng, params, method, 5))
            assert result.finish_reason == "stop"
            assert result.token_ids == plain.token_ids[: plain.token_ids.index(eos)]
    finally:
        eng.close()


def test_seeded_sampling_is_reproducible_and_seeds_differ(engine: Engine) -> None:
    for method in ("none", "ngram", "draft"):

        def sampled(seed: int, method: str = method) -> tuple[int, ...]:
            params = SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True)
            return engine.generate(request("import os\n", engine, params, method)).token_ids

        assert sampled(11) == sampled(11)
        assert sampled(11) != sampled(12)


def test_streamed_deltas_add_up_to_the_result_and_hide_stop_strings(engine: Engine) -> None:
    full = engine.generate(request("class A:\n", engine))
    stop = full.text[6:8]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    handle = engine.submit(request("class A:\n", engine, params, "draft", 3))
    deltas = list(handle)
    text = "".join(d.text for d in deltas)
    assert text == full.text[: full.text.index(stop)]
    assert all(stop not in d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].stats is not None and deltas[-1].stats.num_output_tokens == len(
        [t for d in deltas for t in d.token_ids]
    )


def test_result_after_the_stream_was_read_to_its_end_returns_at_once(engine: Engine) -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    handle = engine.submit(request("class A:\n", engine, params))
    streamed = list(handle)  # the one delta is the last: nothing more will ever arrive
    results: list[GenerationResult] = []
    waiter = threading.Thread(target=lambda: results.append(handle.result()), daemon=True)
    waiter.start()
    waiter.join(timeout=30)
    assert results, "result() waited for a delta after the last one"
    assert results[0].token_ids == tuple(t for d in streamed for t in d.token_ids)
    assert results[0].finish_reason == "length"


def test_statistics_count_drafts_and_passes(engine: Engine) -> None:
    result = engine.generate(request("a b a b a b a b", engine, GREEDY, "ngram", 3))
    stats = result.stats
    assert stats.num_target_passes >= 1
    assert stats.num_draft_tokens >= stats.num_accepted_tokens
    # Each pass yields one token from the target plus the accepted proposals.
    assert stats.num_output_tokens == stats.num_target_passes + stats.num_accepted_tokens
    assert stats.mean_acceptance_length == pytest.approx(
        1 + stats.num_accepted_tokens / stats.num_drafts
    )
    assert stats.time_to_first_token_s > 0 and stats.tokens_per_second > 0


def test_invalid_requests_are_refused_before_queueing(engine: Engine) -> None:
    with pytest.raises(PromptTooLongError):
        engine.submit(request([5] * 500, engine, SamplingParams(max_tokens=100)))
    with pytest.raises(InvalidRequestError) as bad_token:
        engine.submit(request([5, 100_000], engine))
    assert bad_token.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        engine.submit(request([5], engine, SamplingParams(top_p=0.0)))
    with pytest.raises(InvalidRequestError):
        engine.submit(request([5], engine, GREEDY, "draft", MAX_SPECULATIVE_TOKENS + 1))


def test_unloaded_method_is_refused(pair: tuple[Path, Path]) -> None:
    eng = Engine.load(EngineConfig(target=pair[0], dtype="float32"))
    try:
        assert eng.available_methods == ("none", "ngram")
        with pytest.raises(MethodUnavailableError):
            eng.submit(request([5, 6], eng, GREEDY, "draft"))
    finally:
        eng.close()


def test_full_queue_is_refused(pair: tuple[Path, Path]) -> None:
    eng = Engine.load(EngineConfig(target=pair[0], dtype="float32", max_queue=1))
    try:
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        first = eng.submit(request([5, 6], eng, long))
        next(iter(first))  # the worker is busy with it
        second = eng.submit(request([5, 6], eng, long))
        with pytest.raises(QueueFullError):
            eng.submit(request([5, 6], eng, long))
        first.cancel()
        second.cancel()
    finally:
        eng.close()


def test_concurrent_callers_get_their_own_results(engine: Engine) -> None:
    prompts = ["def a():\n", "import sys\n", "x = [1, 2, 3]\n", "class B:\n"]
    expected = {p: engine.generate(request(p, engine)).token_ids for p in prompts}
    results: dict[str, tuple[int, ...]] = {}

    def call(p: str) -> None:
        results[p] = engine.generate(request(p, engine, GREEDY, "draft")).token_ids

    threads = [threading.Thread(target=call, args=(p,)) for p in prompts * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected


def test_fallback_switches_a_bad_method_off_and_back_on(pair: tuple[Path, Path]) -> None:
    events: list[FallbackEvent] = []
    spec = SpeculativeConfig(
        method="ngram",
        acceptance_thresholds={"ngram": 0.6},
        min_speedup=0.0,
        window_tokens=16,
        probe_interval_requests=2,
        num_speculative_tokens=4,
    )
    eng = Engine.load(
        EngineConfig(target=pair[0], dtype="float32", speculative=spec), events.append
    )
    try:
        # Random prompts whose n-gram proposals the target rejects.
        generator = torch.Generator().manual_seed(0)
        for _ in range(6):
            ids = torch.randint(3, 300, (30,), generator=generator).tolist()
            eng.generate(request(ids + ids[:6], eng, GREEDY))
            if events:
                break
        assert [e.action for e in events] == ["disabled"]
        assert events[0].method == "ngram" and events[0].acceptance_rate < 0.6
        assert eng.fallback_state() == {"ngram": True}
        plain = eng.generate(request([7, 8, 9], eng, GREEDY))
        probe = eng.generate(request([7, 8, 9], eng, GREEDY))
        assert {plain.stats.fallback_active, probe.stats.fallback_active} == {True, False}
        # The target's own greedy output repeated: lookup proposals are now accepted.
        good = list(plain.token_ids) * 3
        for _ in range(8):
            eng.generate(request(good, eng, GREEDY))
            if len(events) == 2:
                break
        assert [e.action for e in events] == ["disabled", "enabled"]
        assert eng.fallback_state() == {"ngram": False}
    finally:
        eng.close()


def test_queue_depth_steps_down_to_plain_decoding(pair: tuple[Path, Path]) -> None:
    events: list[FallbackEvent] = []
    spec = SpeculativeConfig(
        method="ngram", acceptance_threshold=0.0, min_speedup=0.0, disable_by_queue_depth=1
    )
    # One sequence at a time, so that the later requests wait (in a batch they would join).
    eng = Engine.load(
        EngineConfig(target=pair[0], dtype="float32", speculative=spec, max_num_seqs=1),
        events.append,
    )
    try:
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        first = eng.submit(request([5, 6], eng, long))
        next(iter(first))
        waiting = eng.submit(request([5, 6], eng, long))
        alone = eng.submit(request([5, 6], eng, GREEDY))
        first.result()
        assert waiting.result().stats.fallback_active is True
        assert alone.result().stats.fallback_active is False
        assert [e.action for e in events] == ["disabled", "enabled"]
        assert "queue depth" in events[0].reason
    finally:
        eng.close()


def test_monitor_needs_a_full_window_before_switching() -> None:
    events: list[FallbackEvent] = []
    monitor = FallbackMonitor(
        "m", {"draft": 0.5}, min_speedup=0.0, window_tokens=10, probe_interval=3,
        costs=PassCosts(), listener=events.append,
    )
    monitor.record("draft", 8, 0)
    assert not monitor.is_disabled("draft")
    monitor.record("draft", 4, 1)
    assert monitor.is_disabled("draft") and events[-1].action == "disabled"
    assert [monitor.admit("draft") for _ in range(6)] == [False, False, True, False, False, True]
    monitor.record("draft", 12, 12)
    assert not monitor.is_disabled("draft") and events[-1].action == "enabled"


def costs_of(per_extra_token: float, draft: float) -> PassCosts:
    costs = PassCosts()
    for tokens in range(1, 10):
        costs.record_target(tokens, 0.020 + per_extra_token * (tokens - 1))
    costs.record_proposer("draft", draft)
    return costs


def test_speculation_length_follows_acceptance_and_cost() -> None:
    flat = costs_of(per_extra_token=0.0005, draft=0.002)  # memory-bound verification
    good = SpeculationLength(max_k=8, prior_alpha=0.5, costs=flat, method="draft")
    poor = SpeculationLength(max_k=8, prior_alpha=0.5, costs=flat, method="draft")
    for _ in range(10):
        good.record(4, 4)
        poor.record(4, 1)
    assert k_alone(adaptive(good)) > k_alone(adaptive(poor)) >= 1
    # Same acceptance rate (one half), once in bursts and once steadily: bursts pay for longer
    # proposals, which a single per-token rate cannot see.
    bursty = SpeculationLength(max_k=8, prior_alpha=0.5, costs=flat, method="draft")
    steady = SpeculationLength(max_k=8, prior_alpha=0.5, costs=flat, method="draft")
    for _ in range(10):
        bursty.record(6, 6)
        bursty.record(6, 0)
        steady.record(6, 3)
        steady.record(6, 3)
    assert k_alone(adaptive(bursty)) > k_alone(adaptive(steady))
    assert bursty.survival()[5] > 0.4 > steady.survival()[5]
    # A fully accepted step makes the next one look one token further.
    hopeful = SpeculationLength(max_k=8, prior_alpha=0.1, costs=flat, method="draft")
    assert k_alone(adaptive(hopeful)) <= 2
    hopeful.record(2, 2)
    assert k_alone(adaptive(hopeful)) >= 3
    # Compute-bound verification and a poor draft: a plain step is cheaper than any proposal.
    steep = costs_of(per_extra_token=0.015, draft=0.008)
    hopeless = SpeculationLength(max_k=8, prior_alpha=0.2, costs=steep, method="draft")
    assert k_alone(adaptive(hopeless)) == 0
    # With nothing measured yet every pass costs the same, so the longest proposal wins, as
    # far as the method's runs reach: one token without evidence, eight after a run of 7.
    unmeasured = SpeculationLength(8, 0.5, PassCosts(), "draft")
    assert k_alone(adaptive(unmeasured)) == 1
    unmeasured.record(7, 7)
    assert k_alone(adaptive(unmeasured)) == 8
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert theoretical_speedup(0.8, 4, 0.1) == pytest.approx(2.4011, abs=1e-4)


def test_run_lengths_censor_full_accepts_and_forget_old_steps() -> None:
    runs = RunLengths(max_k=4)
    runs.record(4, 1)  # accepted the first, stopped at the second
    runs.record(2, 2)  # censored after two
    assert runs.at_risk == [2, 2, 0, 0] and runs.stopped == [0, 1, 0, 0]
    # Prior hazard 0.5 with the weight of one step; positions without data carry the estimate.
    assert runs.hazards(0.5, 1.0) == pytest.approx([1 / 6, 7 / 18, 7 / 18, 7 / 18])
    light = runs.scaled_to(1.0)
    assert light.at_risk == [1, 1, 0, 0] and light.stopped == [0, 0.5, 0, 0]
    fading = RunLengths(max_k=2, decay=0.5)
    fading.record(2, 0)
    fading.record(2, 2)
    assert fading.stopped == [0.5, 0] and fading.at_risk == [1.5, 1]


def test_a_new_request_starts_from_the_engine_wide_run_lengths() -> None:
    flat = costs_of(per_extra_token=0.0005, draft=0.002)
    long_runs, short_runs = RunLengths(8), RunLengths(8)
    for _ in range(50):
        long_runs.record(8, 7)
        short_runs.record(8, 0)
    fresh = SpeculationLength(8, 0.5, flat, "draft", long_runs)
    assert k_alone(adaptive(fresh)) >= 6 and fresh.survival()[0] > 0.8
    assert k_alone(adaptive(SpeculationLength(8, 0.5, flat, "draft", short_runs))) <= 1
    # The request's own steps move it away from the engine-wide curve, and feed it.
    for _ in range(20):
        fresh.record(8, 0)
    assert fresh.survival()[0] < 0.4
    assert long_runs.stopped[0] == 20


def test_an_unsure_draft_stops_early_under_adaptive_k_only(pair: tuple[Path, Path]) -> None:
    def proposed_per_draft(engine: Engine, k: int | None) -> float:
        prompt = engine.tokenizer.encode("def add(a, b):\n")
        stats = engine.generate(request(prompt, engine, GREEDY, "draft", k)).stats
        return stats.num_draft_tokens / stats.num_drafts

    # Every token is below a confidence of 1: the draft stops after its first one.
    unsure = SpeculativeConfig(
        method="draft", acceptance_threshold=0.0, min_speedup=0.0, draft_confidence_threshold=1.0
    )
    eng = Engine.load(EngineConfig(target=pair[0], draft=pair[1], speculative=unsure))
    try:
        assert proposed_per_draft(eng, None) == 1.0
        assert proposed_per_draft(eng, 4) > 1.0
    finally:
        eng.close()


def test_pass_costs_interpolate_between_measured_sizes() -> None:
    costs = PassCosts()
    assert costs.target(3) is None
    costs.record_target(1, 0.010)
    costs.record_target(5, 0.030)
    assert costs.target(3) == pytest.approx(0.020)
    assert costs.target(7) == pytest.approx(0.040)


def test_engine_calibrates_pass_costs_at_load(engine: Engine) -> None:
    for tokens in range(1, engine.speculative_config.max_speculative_tokens + 2):
        assert (engine._costs.target(tokens) or 0) > 0
    assert engine._costs.proposer("draft") > 0


def test_vllm_speculative_config_is_accepted() -> None:
    spec, draft = speculative_config_from_vllm(
        '{"method": "ngram", "num_speculative_tokens": 5,'
        ' "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
    )
    assert (
        spec.method,
        spec.num_speculative_tokens,
        spec.prompt_lookup_min,
        spec.prompt_lookup_max,
        draft,
    ) == ("ngram", 5, 2, 4, None)
    spec, draft = speculative_config_from_vllm(
        {"method": "draft_model", "model": "/models/d", "num_speculative_tokens": 3}
    )
    assert (spec.method, draft) == ("draft", Path("/models/d"))
    with pytest.raises(ValueError, match="lookahead"):
        speculative_config_from_vllm({"method": "lookahead", "model": "x"})
    with pytest.raises(ValueError, match="typo_key"):
        speculative_config_from_vllm({"method": "ngram", "typo_key": 1})


def test_model_version_is_cached_and_follows_the_files(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    model = tmp_path / "m"
    shutil.copytree(pair[0], model)
    first = model_version(model)
    assert first.startswith("sha256:") and (model / CACHE_NAME).exists()
    assert model_version(model) == first
    assert model_version(pair[0]) == first  # content, not location
    (model / "config.json").write_text((model / "config.json").read_text().replace("512", "513"))
    assert model_version(model) != first


def test_read_only_model_directory_caches_elsewhere(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "ro"
    shutil.copytree(pair[0], model)
    (model / CACHE_NAME).unlink(missing_ok=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    write_text = Path.write_text

    def read_only(path: Path, *args: object, **kwargs: object) -> int:
        # The tests run as root, whom file modes do not stop: refuse writes into the model.
        if path.parent == model:
            raise PermissionError(f"read-only: {path}")
        return write_text(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", read_only)
    version = model_version(model)
    assert not (model / CACHE_NAME).exists()
    assert list((tmp_path / "cache" / "specgate" / "versions").glob("*.json"))
    assert model_version(model) == version


def test_incompatible_draft_is_refused_naming_the_difference(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    other = build_model(tmp_path / "other", build_tokenizer(vocab_size=300), seed=3)
    with pytest.raises(IncompatibleDraftError, match="draft embeds only 300 ids"):
        Engine.load(EngineConfig(target=pair[0], draft=other, dtype="float32"))


def test_copy_of_the_target_is_always_accepted(pair: tuple[Path, Path], tmp_path: Path) -> None:
    copy = build_noisy_copy(pair[0], tmp_path / "copy", noise=0.0)
    eng = Engine.load(
        EngineConfig(
            target=pair[0],
            draft=copy,
            dtype="float32",
            speculative=SpeculativeConfig(acceptance_threshold=0.0, min_speedup=0.0),
        )
    )
    try:
        result = eng.generate(request("def f():\n", eng, GREEDY, "draft", 4))
        assert result.stats.acceptance_rate == 1.0
        assert result.stats.num_target_passes == 5  # 24 tokens at 5 per pass
    finally:
        eng.close()


def test_cpu_threads_sets_torch_threads(pair: tuple[Path, Path]) -> None:
    before = torch.get_num_threads()
    try:
        eng = Engine.load(
            EngineConfig(target=pair[0], dtype="float32", device="cpu", cpu_threads=1)
        )
        eng.close()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
