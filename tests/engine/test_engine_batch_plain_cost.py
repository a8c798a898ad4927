"""A batch the speculation policy runs plain costs a plain step: no draft pass runs while
every sequence gets k = 0, and when speculation resumes the drafts that fell behind catch up
in one shared pass; greedy outputs stay those of each request decoded alone.

The step costs are set (the engine's measured ones would follow the load of the machine),
so that the policy's choice per batch size is known; everything else is the real engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig, SpeculativeConfig
from engine.models.batched_runner import Feed
from engine.serving.service import Engine
from engine.speculation.proposers.draft import SHARED_PENDING_ROWS, DraftProposer
from tests.tiny_models import build_noisy_copy, build_pair


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("plain-cost")
    target, _ = build_pair(root)
    draft = build_noisy_copy(target, root / "close", noise=0.3)
    config = EngineConfig(
        target=target,
        draft=draft,
        dtype="float32",
        speculative=SpeculativeConfig(
            method="none", acceptance_threshold=0.0, min_speedup=0.0, prompt_lookup_max=3
        ),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=16,
    )
    eng = Engine.load(config)
    assert eng.batching
    yield eng
    eng.close()


PassLog = list[tuple[int, list[int]]]  # per pass: rows per feed, and whether it kept logits


def draft_request(first: int, max_tokens: int) -> GenerationRequest:
    prompt = (first, 6, 7, 8, 9, 10, 11, 12, 13)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerationRequest(prompt, params, SpeculativeChoice("draft", None))


def spy_passes(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[list[int]], list[list[int]]]:
    """Every target decode pass's and every draft pass's rows per feed, from now on."""
    target_runner = engine._runner
    prototype = engine._proposers["draft"]
    assert target_runner is not None and isinstance(prototype, DraftProposer)
    target_passes: list[list[int]] = []
    draft_passes: list[list[int]] = []

    def spying(log: list[list[int]], shared: Callable[..., object], prefill_too: bool) -> object:
        def spy(feeds: list[Feed], last_only: bool, want_hidden: bool) -> object:
            if prefill_too or not last_only:
                log.append([len(feed.tokens) for feed in feeds])
            return shared(feeds, last_only, want_hidden)

        return spy

    monkeypatch.setattr(
        target_runner, "_shared_pass", spying(target_passes, target_runner._shared_pass, False)
    )
    draft_runner = prototype.pool.runner
    monkeypatch.setattr(
        draft_runner, "_shared_pass", spying(draft_passes, draft_runner._shared_pass, True)
    )
    return target_passes, draft_passes


def set_step_costs(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, seconds: Callable[[int, int], float]
) -> None:
    """The target's step costs, and a draft whose rows cost what the target's do."""
    monkeypatch.setattr(engine._step_costs, "seconds", seconds)
    monkeypatch.setattr(
        engine._costs, "catch_up", lambda method, rows: 0.01 * rows, raising=False
    )


def rows_cost_all(batch: int, width: int) -> float:
    """Every fed row costs the same and a pass nothing else: speculating never pays."""
    return 0.01 * batch * width


def test_a_batch_run_plain_runs_no_draft_pass_and_plain_steps_only(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the batch probed after 33 plain steps: all four drafts caught up on their
    prompt and output, each in a pass of its own, and the target ran a two-row step."""
    set_step_costs(engine, monkeypatch, rows_cost_all)
    built = [draft_request(5 + i, 48) for i in range(4)]
    alone = [engine.generate(request).token_ids for request in built]
    target_passes, draft_passes = spy_passes(engine, monkeypatch)
    handles = [engine.submit(request) for request in built]
    results = [handle.result() for handle in handles]
    assert [result.token_ids for result in results] == alone
    assert draft_passes == []
    assert target_passes and all(max(rows) == 1 for rows in target_passes)
    assert all(set(result.stats.proposal_lengths) == {0} for result in results)


def test_drafts_that_fell_behind_catch_up_in_one_shared_pass(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four draft requests run plain while three or more share the batch; once the two
    short ones are done, speculation pays for the other two, whose draft caches lack their
    prompt and what they committed meanwhile: one catch-up pass for both (before: one each)."""

    def seconds(batch: int, width: int) -> float:
        return rows_cost_all(batch, width) if batch >= 3 else 0.2  # widths free below 3

    set_step_costs(engine, monkeypatch, seconds)
    built = [draft_request(5, 6), draft_request(6, 6), draft_request(7, 30), draft_request(8, 30)]
    alone = [engine.generate(request).token_ids for request in built]
    _, draft_passes = spy_passes(engine, monkeypatch)
    handles = [engine.submit(request) for request in built]
    results = [handle.result() for handle in handles]
    assert [result.token_ids for result in results] == alone
    catch_ups = [rows for rows in draft_passes if max(rows) > SHARED_PENDING_ROWS + 1]
    assert len(catch_ups) == 1 and len(catch_ups[0]) == 2, draft_passes
    assert all(set(result.stats.proposal_lengths) == {0} for result in results[:2])
    assert all(max(result.stats.proposal_lengths) > 0 for result in results[2:])


def test_a_draft_catch_up_pass_computes_no_logits(engine: Engine) -> None:
    prototype = engine._proposers["draft"]
    assert isinstance(prototype, DraftProposer)
    runner = prototype.pool.runner
    head = runner.model.get_output_embeddings()
    assert isinstance(head, torch.nn.Module)
    rows: list[int] = []  # the rows the LM head computes logits for, per pass

    def spy(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        rows.append(inputs[0].numel() // inputs[0].shape[-1])

    # Whichever forward the runner chose at load (HF's modules or engine.models.lean_llama's), the
    # head is called as a module, so the hook sees its rows.
    hook = head.register_forward_pre_hook(spy)
    first, second = prototype.pool.acquire(), prototype.pool.acquire()
    try:
        runner.fill([Feed(first, list(range(5, 25))), Feed(second, list(range(30, 40)))])
        hook.remove()
        assert rows == [2] and runner.lengths[first] == 20 and runner.lengths[second] == 10
        # The cache holds what a pass of its own would have stored.
        with torch.inference_mode():
            after = runner.forward([Feed(second, [41])])[0]
            runner.truncate(second, 0)
            alone = runner.forward([Feed(second, [*range(30, 40), 41])])[0][-1:]
        torch.testing.assert_close(after, alone, rtol=0, atol=1e-4)
    finally:
        hook.remove()
        prototype.pool.release(first)
        prototype.pool.release(second)
