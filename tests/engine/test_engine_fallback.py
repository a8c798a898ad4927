"""Fallback on whether speculation pays, and adaptive k that never locks a method out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.api.types import FallbackEvent, GenerationRequest, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig, SpeculativeConfig
from engine.serving.service import Engine
from engine.speculation.adaptive import FallbackMonitor, PassCosts, RunLengths, SpeculationLength
from engine.speculation.batch_speculation import BatchSpeculation, StepCosts
from tests.decode_alone import adaptive, k_alone
from tests.tiny_models import build_pair

PLAIN = 0.010  # seconds of a one-token target pass in these figures


def flat_costs(proposer: dict[str, float]) -> PassCosts:
    """Memory-bound verification (a pass of n tokens costs 1 + 2 % per extra token) and the
    given per-token proposer costs."""
    costs = PassCosts()
    for tokens in range(1, 18):
        costs.record_target(tokens, PLAIN * (1 + 0.02 * (tokens - 1)))
    for method, seconds in proposer.items():
        costs.record_proposer(method, seconds)
    return costs


def monitor(costs: PassCosts, events: list[FallbackEvent], **spec: object) -> FallbackMonitor:
    config = SpeculativeConfig(window_tokens=64, **spec)  # type: ignore[arg-type]
    return FallbackMonitor(
        "m",
        {m: config.acceptance_threshold_for(m) for m in ("ngram", "draft")},  # type: ignore[misc]
        config.min_speedup,
        config.window_tokens,
        config.probe_interval_requests,
        costs,
        events.append,
    )


def feed(mon: FallbackMonitor, method: str, requests: int) -> None:
    """Requests with 40 % acceptance of 10-token proposals: 5 passes of 10 tokens, 20
    accepted (6 tokens per pass when the proposer is right early)."""
    for _ in range(requests):
        mon.record(method, 50, 20, passes=5)  # type: ignore[arg-type]


def test_cheap_ngram_at_40_percent_stays_on_while_a_costly_draft_is_switched_off() -> None:
    events: list[FallbackEvent] = []
    costs = flat_costs({"ngram": 0.00005, "draft": 0.5 * PLAIN})
    mon = monitor(costs, events)
    feed(mon, "ngram", 6)
    ngram = mon.figures("ngram")
    assert ngram.acceptance_rate == pytest.approx(0.4)
    # 5 tokens a pass against a pass of 11 tokens (1.2 plain) plus 10 lookups.
    assert ngram.speedup == pytest.approx(5 * PLAIN / (1.2 * PLAIN + 10 * 0.00005))
    assert ngram.speedup > 3.5 and not mon.is_disabled("ngram")
    feed(mon, "draft", 6)
    assert mon.is_disabled("draft") and not mon.is_disabled("ngram")
    [event] = events
    assert (event.method, event.action) == ("draft", "disabled")
    assert event.acceptance_rate == pytest.approx(0.4) and event.threshold == 0.6
    assert event.cost_ratio == pytest.approx(0.5)
    assert event.speedup_estimate == pytest.approx(5 / (1.2 + 10 * 0.5))
    assert event.min_speedup == 1.0 and "acceptance rate 0.400 below 0.600" in event.reason
    assert event.as_dict()["speedup_estimate"] == event.speedup_estimate


def test_a_cheap_draft_is_still_held_to_the_60_percent_rule_unless_set_otherwise() -> None:
    cheap = flat_costs({"draft": 0.01 * PLAIN})
    held: list[FallbackEvent] = []
    mon = monitor(cheap, held)
    feed(mon, "draft", 2)
    assert mon.is_disabled("draft") and held[0].speedup_estimate > 3  # type: ignore[operator]
    relaxed: list[FallbackEvent] = []
    mon = monitor(cheap, relaxed, acceptance_thresholds={"draft": 0.3, "ngram": 0.5})
    feed(mon, "draft", 4)
    feed(mon, "ngram", 2)
    assert not mon.is_disabled("draft") and mon.is_disabled("ngram")
    assert relaxed[0].method == "ngram" and relaxed[0].threshold == 0.5


def test_a_speedup_below_the_margin_must_stay_there_before_the_switch() -> None:
    """Speedup estimates rest on timings, so one low window is not enough; acceptance is."""
    events: list[FallbackEvent] = []
    costly = flat_costs({"ngram": 2 * PLAIN})  # an expensive lookup: 5 / (1.2 + 20) < 1
    mon = monitor(costly, events)
    mon.record("ngram", 64, 26, passes=6)
    assert not mon.is_disabled("ngram")
    mon.record("ngram", 10, 4, passes=1)
    assert mon.is_disabled("ngram")
    assert events[0].speedup_estimate < 1 and "estimated speedup" in events[0].reason  # type: ignore[operator]
    # While off, probes whose window shows it pays again switch it back on.
    costly.record_proposer("ngram", 0.0)
    for _ in range(30):
        costly.record_proposer("ngram", 0.00005)
    mon.record("ngram", 64, 26, passes=6)
    assert not mon.is_disabled("ngram") and events[-1].action == "enabled"


def test_one_rejected_token_does_not_make_the_prior_zero() -> None:
    mon = monitor(flat_costs({}), [])
    mon.record("ngram", 1, 0, passes=1)
    assert 0.4 < mon.prior("ngram") < 0.5
    for _ in range(40):
        mon.record("ngram", 8, 0, passes=1)
    assert mon.prior("ngram") < 0.15  # a full window of evidence outweighs the neutral rate


def test_adaptive_k_probes_after_a_run_of_plain_steps() -> None:
    history = RunLengths(8)
    history.record(1, 0)
    pessimistic = SpeculationLength(8, 0.0, flat_costs({"ngram": 0.0}), "ngram", history)
    request = adaptive(pessimistic)
    chooser = BatchSpeculation(StepCosts(pessimistic.costs))
    steps = 3 * SpeculationLength.PROBE_AFTER_PLAIN_STEPS
    choices = [k_alone(request, chooser) for _ in range(steps)]
    assert 0 in choices and choices.count(1) >= 2
    assert pessimistic.plain_steps == choices.count(0)


def test_a_method_adaptive_k_stops_using_is_reported_and_cleared() -> None:
    events: list[FallbackEvent] = []
    mon = monitor(flat_costs({}), events)
    mon.record("ngram", 0, 0, passes=0, steps=8, plain_steps=8)  # too short to tell
    assert not events
    mon.record("ngram", 2, 0, passes=2, steps=40, plain_steps=36)
    assert mon.idle_methods() == {"ngram"} and not mon.is_disabled("ngram")
    assert events[-1].action == "disabled" and "adaptive k chose plain" in events[-1].reason
    mon.record("ngram", 60, 50, passes=12, steps=20, plain_steps=2)
    assert mon.idle_methods() == set() and events[-1].action == "enabled"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("fallback"))


@pytest.fixture
def ngram_engine(pair: tuple[Path, Path]) -> Iterator[Engine]:
    spec = SpeculativeConfig(method="ngram", min_speedup=0.0)
    engine = Engine.load(EngineConfig(target=pair[0], dtype="float32", speculative=spec))
    yield engine
    engine.close()


def greedy(prompt: list[int], tokens: int = 48, method: str = "ngram") -> GenerationRequest:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return GenerationRequest(tuple(prompt), params, SpeculativeChoice(method))  # type: ignore[arg-type]


def hold_costs(engine: Engine, proposer: dict[str, float]) -> None:
    """A quiet machine's pass costs, held fixed (on busy shared cores a stalled pass can make
    a small pass look cheaper than a one-token one and hide what is tested here)."""
    costs = engine._costs
    costs._target.clear()
    for tokens in range(1, 18):
        costs.record_target(tokens, PLAIN * (1 + 0.02 * (tokens - 1)))
    for method, seconds in proposer.items():
        costs.record_proposer(method, seconds)
    costs.record_target = lambda tokens, seconds: None  # type: ignore[method-assign]
    costs.record_proposer = lambda method, seconds: None  # type: ignore[method-assign]


def test_a_draft_adaptive_k_stops_using_shows_as_stopped(pair: tuple[Path, Path]) -> None:
    """A random draft that costs half a target pass: adaptive k runs plain steps (probing
    now and then); the engine reports the method as stopped, with an event."""
    events: list[FallbackEvent] = []
    spec = SpeculativeConfig(method="draft", acceptance_threshold=0.0, min_speedup=0.0)
    engine = Engine.load(
        EngineConfig(target=pair[0], draft=pair[1], dtype="float32", speculative=spec),
        events.append,
    )
    try:
        hold_costs(engine, {"draft": 0.5 * PLAIN})
        for start in range(3, 6):
            stats = engine.generate(greedy([start, 9, 11], 48, "draft")).stats
            assert stats.num_drafts > 0  # probes
        assert engine.fallback_state() == {"ngram": False, "draft": True}
        [event] = events
        assert event.action == "disabled" and "adaptive k chose plain" in event.reason
    finally:
        engine.close()


def test_one_early_rejection_does_not_lock_adaptive_k_at_zero(ngram_engine: Engine) -> None:
    """The engine's state after a first n-gram request whose one proposed token was rejected
    (history and window: one token, 0 %), with pass costs held fixed. Before the fix every later
    request ran plain for good, with no event; now they speculate and get back to long
    proposals."""
    engine = ngram_engine
    hold_costs(engine, {"ngram": 0.00005})
    plain = engine.generate(greedy([7, 8, 9], 40, "none")).token_ids
    engine._monitor.record("ngram", 1, 0, passes=1)
    engine._run_lengths["ngram"].record(1, 0)
    repeated = list(plain) * 3
    first = engine.generate(greedy(repeated)).stats
    assert first.num_draft_tokens > 0 and first.num_accepted_tokens > 0
    later = [engine.generate(greedy(repeated)).stats for _ in range(3)]
    assert later[-1].num_draft_tokens / later[-1].num_drafts > 2  # k is back above 1
    assert engine.fallback_state() == {"ngram": False}
