"""Prefill chunks bounded in time: on a machine where a chunk of ``long_prefill_token_threshold``
tokens takes longer than ``max_prefill_chunk_seconds``, chunks are cut to what the measured
cost per prompt token allows, so a request arriving behind a long prompt waits for a short
pass, and the outputs stay those of each request alone."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig, SpeculativeConfig
from engine.models.batched_runner import Feed
from engine.serving.prefill_pace import MIN_CHUNK_TOKENS, PrefillPace
from engine.serving.service import Engine
from engine.speculation.adaptive import PassCosts
from tests.tiny_models import build_pair

SLOW_PER_TOKEN_S = 1 / 512  # what each prompt token of a chunk pass costs on the slowed runner
BOUND_S = 0.0625  # with the figures below, exact in binary
FIXED_S = 1 / 64  # the one-token pass


def costs_with_one_token_pass(seconds: float) -> PassCosts:
    costs = PassCosts()
    costs.record_target(1, seconds)
    return costs


def test_a_chunk_is_cut_to_what_the_bound_allows_at_the_measured_cost() -> None:
    pace = PrefillPace(BOUND_S, costs_with_one_token_pass(FIXED_S))
    assert pace.limit(128) == 128  # nothing measured yet: the token threshold
    pace.record(32, FIXED_S + 32 * SLOW_PER_TOKEN_S)
    assert pace.limit(128) == 24  # (BOUND_S - FIXED_S) / SLOW_PER_TOKEN_S
    assert pace.limit(20) == 20  # never more than the threshold


def test_a_descheduled_pass_does_not_move_the_estimate() -> None:
    pace = PrefillPace(BOUND_S, costs_with_one_token_pass(FIXED_S))
    for seconds in (0.078125, 0.078125, 5.0, 0.078125):
        pace.record(32, seconds)
    assert pace.limit(128) == 24


def test_prefill_advances_on_a_machine_slower_than_the_bound() -> None:
    pace = PrefillPace(BOUND_S, costs_with_one_token_pass(0.05))
    pace.record(32, 1.0)
    assert pace.limit(128) == MIN_CHUNK_TOKENS


def test_small_chunks_and_no_bound_leave_the_threshold() -> None:
    pace = PrefillPace(BOUND_S, costs_with_one_token_pass(0.01))
    pace.record(3, 1.0)  # mostly the fixed part of a pass: not a per-token figure
    assert pace.limit(128) == 128
    unbounded = PrefillPace(None, costs_with_one_token_pass(0.01))
    unbounded.record(32, 1.0)
    assert unbounded.limit(128) == 128


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_pair(tmp_path_factory.mktemp("pace"))[0]


def serve_slowly(
    target: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Engine, list[tuple[int, int]]]:
    """An engine whose prefill chunk passes cost ``SLOW_PER_TOKEN_S`` per prompt token more
    than the tiny model's (the slow CPU the bound is for); its chunks as (slot, tokens)."""
    engine = Engine.load(
        EngineConfig(
            target=target,
            dtype="float32",
            speculative=SpeculativeConfig(method="none"),
            max_num_seqs=4,
            max_num_batched_tokens=512,
            long_prefill_token_threshold=128,
            max_prefill_chunk_seconds=BOUND_S,
        )
    )
    runner = engine._runner
    assert runner is not None
    chunks: list[tuple[int, int]] = []
    forward = runner.forward

    def slow(feeds: list[Feed], last_only: bool = False) -> list[torch.Tensor]:
        if last_only:
            chunks.append((feeds[0].slot, len(feeds[0].tokens)))
            time.sleep(SLOW_PER_TOKEN_S * len(feeds[0].tokens))
        return forward(feeds, last_only)

    monkeypatch.setattr(runner, "forward", slow)
    return engine, chunks


def request(prompt: list[int], max_tokens: int) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerationRequest(tuple(prompt), params, SpeculativeChoice("none", None))


def test_chunks_of_a_long_prompt_are_cut_to_the_bound_on_a_slow_machine(
    target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, chunks = serve_slowly(target, monkeypatch)
    try:
        long_request = request([3 + i % 300 for i in range(400)], 4)
        short_request = request([5, 6, 7], 4)
        long = engine.submit(long_request)  # slot 0
        short = engine.submit(short_request)
        long_tokens, short_tokens = long.result().token_ids, short.result().token_ids
        long_chunks = [tokens for slot, tokens in chunks if slot == 0]
        assert sum(long_chunks) == 399
        # The first chunk runs before any cost is measured; after it, every chunk is cut so
        # that its pass stays within the bound at the measured cost (at least SLOW_PER_TOKEN_S a
        # token), and all but the remainder keep at least MIN_CHUNK_TOKENS.
        assert long_chunks[0] == 128
        assert max(long_chunks[1:]) <= int(BOUND_S / SLOW_PER_TOKEN_S)
        assert min(long_chunks[1:-1]) >= MIN_CHUNK_TOKENS
        # A prompt the threshold prefills in one pass keeps that pass, cost measured or not.
        del chunks[:]
        medium_request = request([4 + i % 300 for i in range(100)], 2)
        medium_tokens = engine.submit(medium_request).result().token_ids
        assert chunks == [(0, 99)]
    finally:
        engine.close()
    plain = Engine.load(
        EngineConfig(target=target, dtype="float32", speculative=SpeculativeConfig(method="none"))
    )
    try:
        assert long_tokens == plain.generate(long_request).token_ids
        assert short_tokens == plain.generate(short_request).token_ids
        assert medium_tokens == plain.generate(medium_request).token_ids
    finally:
        plain.close()
