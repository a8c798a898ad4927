"""The batched KV cache's memory: each slot grows on its own, and the KV budget bounds it.

A long prompt among short ones must not make every slot as long as itself; a shared pass
over slots of very different lengths gives each sequence the logits it gets alone; a slot's
growth past its first buffer keeps what it held; and the engine never allocates more cache
positions than ``max_kv_tokens``, holding requests back in the queue instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig, SpeculativeConfig
from engine.models.batched_cache import INITIAL_CAPACITY
from engine.models.batched_runner import BatchedRunner, Feed
from engine.models.model_runner import ModelRunner
from engine.serving.scheduler import reservation
from engine.serving.service import Engine
from tests.tiny_models import build_pair


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_pair(tmp_path_factory.mktemp("batch-memory"))[0]


def _chunks(tokens: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(tokens), size):
        yield tokens[start : start + size]


def test_a_long_prompt_grows_only_its_own_slot(target: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    batched = BatchedRunner(model, 4)
    cache = batched.cache
    long_prompt = [3 + (i * 7) % 300 for i in range(3 * INITIAL_CAPACITY + 10)]
    shorts = [[5 + s, 6, 7, 8, 9] for s in range(3)]
    short_reservation = reservation(5, 8)
    batched.forward([Feed(0, long_prompt[:50])], last_only=True)  # its first extent
    for slot, prompt in enumerate(shorts, start=1):
        batched.reserve(slot, short_reservation)
        batched.forward([Feed(slot, prompt[:-1])], last_only=True)
    # Slot 0 has no reservation: it doubles, past the short extents (packed, moved up).
    for chunk in _chunks(long_prompt[50:-1], 100):
        batched.forward([Feed(0, chunk)], last_only=True)
    assert cache.capacity(0) >= len(long_prompt)
    assert [cache.capacity(slot) for slot in (1, 2, 3)] == [short_reservation] * 3
    assert cache.allocated_positions() == cache.capacity(0) + 3 * short_reservation
    # One shared pass over all four: each sequence's logits are its own alone.
    shared = batched.forward(
        [Feed(0, [long_prompt[-1], 11, 12]), *(Feed(s, [p[-1]]) for s, p in enumerate(shorts, 1))]
    )
    for slot, prompt in [(0, long_prompt), *enumerate(shorts, start=1)]:
        alone = ModelRunner(model)
        alone.forward(prompt[:-1], last_only=True)
        rows = [prompt[-1], 11, 12] if slot == 0 else [prompt[-1]]
        expected = alone.forward(rows)
        torch.testing.assert_close(shared[slot], expected, rtol=0, atol=1e-4)
    # The long prompt's extent is free space once it leaves: new requests take it.
    size = cache.allocated_positions()
    batched.release(0)
    for prompt in shorts:
        batched.release(1)
        batched.reserve(1, short_reservation)
        batched.forward([Feed(1, prompt[:-1])], last_only=True)
        batched.forward([Feed(0, prompt[:-1])], last_only=True)
    assert cache.allocated_positions() == size


def test_moving_a_slot_moves_its_cache(target: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    batched, alone = BatchedRunner(model, 3), ModelRunner(model)
    prompt = [40, 41, 42, 43, 44, 45]
    batched.forward([Feed(2, prompt[:-1])], last_only=True)
    batched.move_slot(2, 0)
    assert batched.cache.capacity(2) == 0
    alone.forward(prompt[:-1], last_only=True)
    moved = batched.forward([Feed(0, prompt[-1:])])[0]
    torch.testing.assert_close(moved, alone.forward(prompt[-1:]), rtol=0, atol=1e-4)


def test_the_kv_budget_bounds_what_the_cache_allocates(
    target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt_tokens, max_tokens = 30, 12
    one = reservation(prompt_tokens, max_tokens)
    budget = 2 * one + one // 2  # room for two requests' reservations, not three
    config = EngineConfig(
        target=target,
        dtype="float32",
        speculative=SpeculativeConfig(method="none"),
        max_num_seqs=4,
        max_kv_tokens=budget,
    )
    engine = Engine.load(config)
    try:
        runner = engine._runner
        assert runner is not None
        allocated: list[int] = []
        running: list[int] = []
        forward = runner.forward

        def spy(feeds: list[Feed], last_only: bool = False) -> list[torch.Tensor]:
            out = forward(feeds, last_only)
            allocated.append(runner.cache.allocated_positions())
            assert engine._scheduler is not None
            running.append(len(engine._scheduler.running))
            return out

        monkeypatch.setattr(runner, "forward", spy)
        built = [
            GenerationRequest(
                tuple(3 + (i * 11 + j) % 300 for j in range(prompt_tokens)),
                SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                SpeculativeChoice("none", None),
            )
            for i in range(4)
        ]
        handles = [engine.submit(request) for request in built]
        results = [handle.result() for handle in handles]
        assert all(len(result.token_ids) == max_tokens for result in results)
        assert max(running) == 2  # the others waited for a place
        assert 0 < max(allocated) <= budget
    finally:
        engine.close()
