"""Continuous batching: every sequence of a shared batch gets what it would get alone.

Greedy outputs equal the request decoded alone (float32), whatever the mix of methods, k,
lengths and stop conditions, with requests joining mid-batch and others cancelled; seeded
sampled outputs do not depend on what else shares the batch; the batched runner's tree pass
and path compaction give the logits of the equivalent chain.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig, SpeculativeConfig
from engine.models.batched_runner import BatchedRunner, Feed
from engine.models.model_runner import ModelRunner
from engine.serving.service import Engine
from engine.speculation.adaptive import PassCosts, RunLengths, SpeculationLength
from engine.speculation.batch_speculation import BatchSpeculation, Sequence, StepCosts, crossover
from engine.speculation.proposers import NgramProposer
from engine.speculation.proposers.draft import DraftProposer
from engine.speculation.request import Speculation
from tests.engine.test_engine_sampling import (
    SAMPLES,
    SIGNIFICANCE,
    chi_square_p_value,
    exact_pair_distribution,
)
from tests.tiny_models import build_noisy_copy, build_pair

NO_FALLBACK = SpeculativeConfig(
    method="none", acceptance_threshold=0.0, min_speedup=0.0, prompt_lookup_max=3
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("batching")
    target, _ = build_pair(root)
    draft = build_noisy_copy(target, root / "close", noise=0.3)
    return target, draft


@pytest.fixture(scope="module")
def engine(models: tuple[Path, Path]) -> Iterator[Engine]:
    target, draft = models
    config = EngineConfig(
        target=target,
        draft=draft,
        dtype="float32",
        speculative=NO_FALLBACK,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=16,  # long prompts prefill in several chunks
    )
    eng = Engine.load(config)
    assert eng.batching
    yield eng
    eng.close()


def make_request(
    prompt: list[int], method: str, k: int | None, max_tokens: int, **sampling: object
) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)  # type: ignore[arg-type]
    return GenerationRequest(tuple(prompt), params, SpeculativeChoice(method, k))  # type: ignore[arg-type]


requests = st.tuples(
    st.lists(st.integers(min_value=3, max_value=319), min_size=1, max_size=40),
    st.sampled_from(["none", "ngram", "draft"]),
    st.one_of(st.none(), st.integers(min_value=1, max_value=6)),
    st.integers(min_value=1, max_value=24),
)


@settings(max_examples=6, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=st.lists(requests, min_size=2, max_size=6), late=st.integers(min_value=0, max_value=5))
def test_greedy_outputs_in_a_batch_equal_each_request_alone(
    engine: Engine, mix: list[tuple[list[int], str, int | None, int]], late: int
) -> None:
    built = [make_request(p, m, k, n, temperature=0.0) for p, m, k, n in mix]
    alone = [engine.generate(request).token_ids for request in built]
    # The first `late` requests start; the rest join once the first has streamed a token.
    first = [engine.submit(request) for request in built[:late]]
    if first:
        next(iter(first[0]))
    handles = first + [engine.submit(request) for request in built[late:]]
    assert [handle.result().token_ids for handle in handles] == alone


def test_cancelled_neighbours_leave_the_others_unchanged(engine: Engine) -> None:
    prompts = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44, 45]]
    built = [make_request(p, "ngram", None, 30, temperature=0.0) for p in prompts]
    alone = [engine.generate(request).token_ids for request in built]
    doomed = [engine.submit(make_request([7] * 30, "draft", 4, 200, temperature=0.0))]
    handles = [engine.submit(request) for request in built]
    next(iter(doomed[0]))
    doomed[0].cancel()
    assert [handle.result().token_ids for handle in handles] == alone


def test_seeded_sampling_does_not_depend_on_the_batch(engine: Engine) -> None:
    seeded = make_request([5, 6, 7], "draft", 3, 40, temperature=1.0, seed=1234)
    alone = engine.generate(seeded).token_ids
    others = [
        make_request([20 + i, 21, 22], method, 2, 40, temperature=0.8)
        for i, method in enumerate(["none", "ngram", "draft"])
    ]
    handles = [engine.submit(request) for request in others[:2]]
    mine = engine.submit(seeded)
    handles.append(engine.submit(others[2]))
    assert mine.result().token_ids == alone
    for handle in handles:
        handle.result()


def test_each_request_records_the_most_sequences_its_steps_shared(engine: Engine) -> None:
    """What a replay needs to know: 1 for a request that ran alone, the batch it shared
    otherwise (``GenerationStats.max_batch_size``, recorded in the completion event)."""
    alone = engine.generate(make_request([5, 6, 7], "none", None, 8, temperature=0.0))
    assert alone.stats.max_batch_size == 1
    handles = [
        engine.submit(make_request([30 + i, 31, 32], "none", None, 40, temperature=0.0))
        for i in range(3)
    ]
    assert [handle.result().stats.max_batch_size for handle in handles] == [3, 3, 3]


def test_concurrent_submitters_all_complete(engine: Engine) -> None:
    results: list[tuple[int, ...]] = []
    lock = threading.Lock()
    built = [make_request([3 + i, 4, 5], "none", None, 12, temperature=0.0) for i in range(8)]

    def client(request: GenerationRequest) -> None:
        tokens = engine.generate(request).token_ids
        with lock:
            results.append(tokens)

    threads = [threading.Thread(target=client, args=(r,)) for r in built]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(results) == sorted(engine.generate(r).token_ids for r in built)


def test_tree_pass_and_keep_path_match_the_chain(models: tuple[Path, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
    batched, single = BatchedRunner(model, 3), ModelRunner(model)
    prefix, other = [5, 6, 7, 8, 9], [30, 31, 32, 33, 34, 35, 36, 37]
    batched.forward([Feed(1, other)], last_only=True)
    batched.forward([Feed(0, prefix[:-1])], last_only=True)
    # Tree under the last token 9: nodes 0 (11) and 1 (12) are root children, 2 (13) under
    # 0, 3 (14) under 1; the other sequence decodes a chain of 3 beside it.
    tree = batched.forward([Feed(0, [9, 11, 12, 13, 14], (-1, -1, 0, 1)), Feed(1, [38, 39, 40])])[0]
    single.forward(prefix[:-1], last_only=True)
    chain = single.forward([9, 12, 14])
    for tree_row, chain_row in ((0, 0), (2, 1), (4, 2)):
        torch.testing.assert_close(tree[tree_row], chain[chain_row], rtol=0, atol=1e-4)
    batched.keep_path(0, len(prefix), [1, 3])
    assert batched.lengths[0] == len(prefix) + 2
    after = batched.forward([Feed(0, [15])])[0]
    torch.testing.assert_close(after[0], single.forward([15])[0], rtol=0, atol=1e-4)


def test_a_short_request_is_not_stuck_behind_a_long_prompt(engine: Engine) -> None:
    # The fixture's budget is 16 rows a step: the long prompt takes 25 steps to prefill.
    long = engine.submit(
        make_request([3 + i % 300 for i in range(400)], "none", None, 4, temperature=0.0)
    )
    short_request = make_request([5, 6, 7], "none", None, 4, temperature=0.0)
    short = engine.submit(short_request)
    short_result, long_result = short.result(), long.result()
    assert short_result.stats.total_time_s < long_result.stats.time_to_first_token_s
    assert short_result.token_ids == engine.generate(short_request).token_ids


def test_a_short_request_decodes_before_the_long_prompt_prefill_goes_on(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt the step budget could finish at once is still cut into chunks, and a chunk
    that does not finish its prompt waits for the decode pass: the short request behind it
    gets its first token while the long prompt is still being prefilled."""
    runner = engine._runner
    assert runner is not None
    passes: list[tuple[bool, list[int]]] = []  # (prefill chunk, the feeds' lengths)
    forward = runner.forward

    def spy(feeds: list[Feed], last_only: bool = False) -> list[torch.Tensor]:
        passes.append((last_only, [len(feed.tokens) for feed in feeds]))
        return forward(feeds, last_only)

    monkeypatch.setattr(runner, "forward", spy)
    long_prompt = [3 + i % 300 for i in range(50)]  # fits the 64-row budget of one step
    long = engine.submit(make_request(long_prompt, "none", None, 2, temperature=0.0))
    short_request = make_request([5, 6, 7], "none", None, 2, temperature=0.0)
    short = engine.submit(short_request)
    short_result, long_result = short.result(), long.result()
    short_first = short.submitted_at + short_result.stats.time_to_first_token_s
    long_first = long.submitted_at + long_result.stats.time_to_first_token_s
    assert short_first < long_first
    chunks = [lengths[0] for prefill, lengths in passes if prefill]
    assert max(chunks) <= 16 and sum(chunks) == len(long_prompt) - 1 + 2
    after_short = passes.index((True, [2])) + 1
    assert passes[after_short][0] is False  # the decode pass, before any more of the long one
    assert short_result.token_ids == engine.generate(short_request).token_ids


def test_the_draft_drafts_for_every_draft_sequence_in_shared_passes(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prototype = engine._proposers["draft"]
    assert isinstance(prototype, DraftProposer)
    pool = prototype.pool
    feeds_per_pass: list[int] = []
    forward = pool.runner.forward

    def spy(feeds: list[Feed], last_only: bool = False) -> list[torch.Tensor]:
        if not last_only:  # catch-up passes of one sequence's prompt are last_only
            feeds_per_pass.append(len(feeds))
        return forward(feeds, last_only)

    built = [make_request([5 + i, 6, 7, 8], "draft", 3, 16, temperature=0.0) for i in range(3)] + [
        make_request([50, 51, 52], "draft", 2, 16, temperature=0.7, seed=3)
    ]
    alone = [engine.generate(request).token_ids for request in built]
    monkeypatch.setattr(pool.runner, "forward", spy)
    handles = [engine.submit(request) for request in built]
    assert [handle.result().token_ids for handle in handles] == alone
    assert max(feeds_per_pass) == len(built)  # one pass drafted for all four
    # Every finished request gives its draft slot back (the engine's own proposer may hold
    # one); the worker frees them just after it delivers the results.
    deadline = time.monotonic() + 10
    while len(pool._free) < pool.runner.max_slots - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pool._free) >= pool.runner.max_slots - 1


def test_batch_invariant_mode_runs_each_sequence_in_a_pass_of_its_own(
    models: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, draft = models
    config = EngineConfig(
        target=target,
        draft=draft,
        dtype="float32",
        speculative=NO_FALLBACK,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        long_prefill_token_threshold=16,
        batch_invariant=True,
    )
    eng = Engine.load(config)
    try:
        built = [
            make_request([3 + i % 200 for i in range(40 + i)], method, 2, 12, temperature=0.0)
            for i, method in enumerate(["none", "ngram", "draft", "none"])
        ]
        alone = [eng.generate(request).token_ids for request in built]
        widths: list[int] = []
        chunks: list[int] = []
        runner = eng._runner
        assert runner is not None and runner.invariant
        shared = runner._shared_pass

        def spy(
            feeds: list[Feed], last_only: bool, want_hidden: bool
        ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
            widths.append(len(feeds))
            if last_only:
                chunks.append(len(feeds[0].tokens))
            return shared(feeds, last_only, want_hidden)

        monkeypatch.setattr(runner, "_shared_pass", spy)
        handles = [eng.submit(request) for request in built]
        assert [handle.result().token_ids for handle in handles] == alone
        assert set(widths) == {1}
        # Chunks at fixed boundaries: 16-token chunks and each prompt's remainder, never cut
        # to what a step's budget left.
        remainders = {(len(request.prompt_ids) - 1) % 16 for request in built}
        assert set(chunks) <= {16, *remainders}
    finally:
        eng.close()


@pytest.mark.slow
def test_sampling_stays_exact_per_sequence_in_a_shared_batch(engine: Engine) -> None:
    """Draft speculation sampled while plain and n-gram requests share every batch: the
    first two tokens follow the target's distribution (Pearson, as in test_engine_sampling)."""
    params = SamplingParams(max_tokens=2, temperature=1.0, ignore_eos=True)
    prompt = engine.tokenizer.encode("def add(a, b):\n")
    counts: Counter[tuple[int, int]] = Counter()
    wave = 8
    for start in range(0, SAMPLES, wave):
        mine = [
            engine.submit(
                GenerationRequest(
                    tuple(prompt),
                    SamplingParams(**{**params.__dict__, "seed": seed}),
                    SpeculativeChoice("draft", 2),
                )
            )
            for seed in range(start, min(start + wave, SAMPLES))
        ]
        neighbours = [
            engine.submit(make_request([9 + i, 10, 11], method, 3, 6, temperature=0.7))
            for i, method in enumerate(["none", "ngram", "draft"])
        ]
        for handle in mine:
            tokens = handle.result().token_ids
            counts[(tokens[0], tokens[1])] += 1
        for handle in neighbours:
            handle.result()
    exact = exact_pair_distribution(engine, prompt, params)
    assert chi_square_p_value(counts, exact) > SIGNIFICANCE


def cpu_like_costs(per_row: float = 0.004, fixed: float = 0.02) -> PassCosts:
    """A pass whose cost grows with every row fed, as on two CPU cores."""
    costs = PassCosts()
    for rows in (1, 2, 4, 8, 16, 32, 64, 128):
        costs.record_target(rows, fixed + per_row * rows)
    costs.record_proposer("ngram", 0.0)
    return costs


def adaptive(
    costs: PassCosts, accepted: tuple[int, ...], proposed: int = 4, fixed_k: int | None = None
) -> Speculation:
    """An n-gram request whose steps of ``proposed`` tokens accepted ``accepted``, in turn."""
    length = SpeculationLength(8, 0.5, costs, "ngram", RunLengths(8))
    for _ in range(10):
        for count in accepted:
            length.record(proposed, count)
    return Speculation(NgramProposer(1, 3), fixed_k, length)


def test_speculation_shrinks_with_the_batch_and_stops_at_a_measured_crossover() -> None:
    costs = cpu_like_costs()
    steps = StepCosts(costs)
    chooser = BatchSpeculation(steps)
    half = Sequence(adaptive(costs, (0, 2)), 0, 100)  # half the steps accept two, half none
    ks = [chooser.lengths([half] * batch)[0] for batch in (1, 4, 16)]
    assert ks[0] >= ks[1] >= ks[2] == 0 < ks[0]
    fresh = half.speculation.length  # type: ignore[union-attr]
    found = crossover(steps, fresh, 16)
    assert 1 < found <= 16
    # The crossover is a fresh batch's choice (a running one keeps its k within a margin).
    assert BatchSpeculation(steps).lengths([half] * int(found))[0] == 0
    assert BatchSpeculation(steps).lengths([half] * (int(found) - 1))[0] > 0
    # Free passes (memory-bound): speculation pays at every batch size.
    assert crossover(StepCosts(cpu_like_costs(per_row=0.0)), fresh, 16) == float("inf")


def test_one_speculating_sequence_pays_for_its_own_rows_beside_plain_ones() -> None:
    """A pass costs its rows, not every sequence padded to the longest (the lean forward), and
    the plain sequences' tokens count in the batch's rate: a proposal that pays for its rows
    beside seven plain requests is made, one that does not is not."""
    for per_row, speculates in ((0.002, True), (0.004, False)):
        costs = cpu_like_costs(per_row=per_row)
        chooser = BatchSpeculation(StepCosts(costs))
        good = Sequence(adaptive(costs, (0, 4)), 0, 100)
        alone = chooser.lengths([good])[0]
        assert alone > 0
        beside = chooser.lengths([good, *[Sequence(None, 0, 100)] * 7])
        assert (beside[0] > 0) == speculates and beside[1:] == [0] * 7


def test_each_sequence_of_a_batch_proposes_as_its_own_acceptance_pays() -> None:
    """Beside seven n-gram requests whose proposals are never accepted, the one whose
    proposals are speculates alone: one length for all made the seven propose too, or, where
    their rows did not pay, kept the good one at plain steps."""
    costs = cpu_like_costs(per_row=0.002)
    good = Sequence(adaptive(costs, (0, 4)), 0, 100)
    poor = [Sequence(adaptive(costs, (0,)), 0, 100) for _ in range(7)]
    ks = BatchSpeculation(StepCosts(costs)).lengths([good, *poor])
    assert ks[0] > 0 and ks[1:] == [0] * 7


def test_a_sequence_running_plain_beside_a_speculating_one_still_probes() -> None:
    """Beside a request whose proposals are always accepted, one whose proposals never are
    runs plain and proposes a token now and then (a row each, at most one per
    ``PROBE_AFTER_PLAIN_STEPS`` steps of the batch), so its curve can rise if its reply starts
    to quote; without that it stayed plain for as long as the other speculated."""
    costs = cpu_like_costs(per_row=0.002)
    chooser = BatchSpeculation(StepCosts(costs))
    good = Sequence(adaptive(costs, (4,)), 0, 1000)
    poor = Sequence(adaptive(costs, (0,)), 0, 1000)
    rounds = [chooser.lengths([good, poor]) for _ in range(100)]
    assert all(ks[0] > 0 for ks in rounds)
    probes = [ks[1] for ks in rounds if ks[1]]
    assert probes and set(probes) == {1}
    assert len(probes) <= len(rounds) // chooser.PROBE_AFTER_PLAIN_STEPS


def test_a_fixed_k_is_proposed_whole_and_a_plain_batch_probes_rarely() -> None:
    costs = cpu_like_costs()
    chooser = BatchSpeculation(StepCosts(costs))
    poor = [Sequence(adaptive(costs, (0,)), 0, 100) for _ in range(4)]
    pinned = Sequence(adaptive(costs, (0,), fixed_k=3), 0, 100)
    assert chooser.lengths([*poor, pinned]) == [0, 0, 0, 0, 3]  # each its own length
    chooser.plain_run = 0
    rounds = [chooser.lengths(poor) for _ in range(3 * 4 * chooser.PROBE_AFTER_PLAIN_STEPS)]
    probes = [ks for ks in rounds if any(ks)]
    assert probes and all(ks == [1, 1, 1, 1] for ks in probes)
    assert len(probes) <= 3  # once per PROBE_AFTER_PLAIN_STEPS plain steps per sequence
    assert poor[0].speculation is not None
    assert poor[0].speculation.length.plain_steps == 1 + len(rounds) - len(probes)


def test_step_costs_keep_the_calibrated_shape_at_the_measured_level() -> None:
    costs = cpu_like_costs()
    steps = StepCosts(costs)
    assert steps.seconds(4, 8) == costs.target(8)
    steps.record(4, 4, 2 * (costs.target(4) or 0.0))  # batched steps cost twice the stand-in
    assert steps.seconds(4, 4) == pytest.approx(2 * (costs.target(4) or 0.0))
    assert steps.seconds(4, 12) == pytest.approx(2 * (costs.target(12) or 0.0))
    assert steps.seconds(2, 6) == costs.target(6)  # other batch sizes are not moved
    steps.record(4, 8, 0.001)  # a longer step measured cheaper than a shorter one: noise
    assert steps.seconds(4, 8) == steps.seconds(4, 4)
