"""Prometheus metrics: exact counter values from engine stats, gauges read at scrape time."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from engine.api.types import FallbackEvent, GenerationStats, Method
from gateway.observability.metrics import Metrics


def samples(metrics: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the exposition, keyed by name and label set."""
    text = metrics.exposition().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, frozenset(labels.items()))]


stats_strategy = st.builds(
    GenerationStats,
    method=st.sampled_from(["ngram", "draft"]),
    num_prompt_tokens=st.integers(1, 500),
    num_output_tokens=st.integers(1, 500),
    num_drafts=st.integers(1, 100),
    num_draft_tokens=st.integers(0, 400),
    num_accepted_tokens=st.integers(0, 400),
    num_target_passes=st.integers(1, 500),
    time_to_first_token_s=st.floats(0.0, 5.0),
)


@given(st.lists(stats_strategy, min_size=1, max_size=8))
def test_speculation_counters_add_up_per_method_and_model(all_stats: list[GenerationStats]) -> None:
    metrics = Metrics()
    for stats in all_stats:
        metrics.observe_generation("demo", stats)
    for method in ("ngram", "draft"):
        mine = [s for s in all_stats if s.method == method]
        if not mine:
            continue
        labels = {"method": method, "model": "demo"}
        assert value(metrics, "specgate_spec_decode_num_drafts_total", **labels) == sum(
            s.num_drafts for s in mine
        )
        assert value(metrics, "specgate_spec_decode_num_draft_tokens_total", **labels) == sum(
            s.num_draft_tokens for s in mine
        )
        assert value(metrics, "specgate_spec_decode_num_accepted_tokens_total", **labels) == sum(
            s.num_accepted_tokens for s in mine
        )
        assert value(metrics, "specgate_spec_decode_target_passes_total", **labels) == sum(
            s.num_target_passes for s in mine
        )
    assert value(metrics, "specgate_generation_tokens_total", model="demo") == sum(
        s.num_output_tokens for s in all_stats
    )
    assert value(metrics, "specgate_prompt_tokens_total", model="demo") == sum(
        s.num_prompt_tokens for s in all_stats
    )
    assert value(metrics, "specgate_time_to_first_token_seconds_count", model="demo") == len(
        all_stats
    )


def test_plain_decoding_counts_target_passes_but_no_drafts() -> None:
    metrics = Metrics()
    metrics.observe_generation(
        "demo",
        GenerationStats(
            method="none", num_prompt_tokens=5, num_output_tokens=7, num_target_passes=7
        ),
    )
    assert (
        value(metrics, "specgate_spec_decode_target_passes_total", method="none", model="demo") == 7
    )
    names = {name for name, _ in samples(metrics)}
    assert "specgate_spec_decode_num_drafts_total" not in names


def test_requests_audit_writes_and_fallback_switches() -> None:
    metrics = Metrics()
    metrics.observe_request("/v1/chat/completions", 200, 0.3)
    metrics.observe_request("/v1/chat/completions", 200, 0.2)
    metrics.observe_request("/v1/chat/completions", 429, 0.001)
    metrics.observe_audit_write("request", 0.002, failed=False)
    metrics.observe_audit_write("completion", 0.004, failed=True)
    for action in ("disabled", "enabled", "disabled"):
        metrics.observe_fallback(
            FallbackEvent("draft", "demo", action, "low acceptance", 0.1, 8, 0.99)  # type: ignore[arg-type]
        )
    route = "/v1/chat/completions"
    assert value(metrics, "specgate_requests_total", route=route, status="200") == 2
    assert value(metrics, "specgate_requests_total", route=route, status="429") == 1
    assert value(metrics, "specgate_request_duration_seconds_count", route=route) == 3
    assert value(metrics, "specgate_request_duration_seconds_sum", route=route) == 0.501
    assert value(metrics, "specgate_request_duration_seconds_bucket", route=route, le="0.25") == 2
    assert value(metrics, "specgate_audit_write_duration_seconds_count", kind="request") == 1
    assert value(metrics, "specgate_audit_write_failures_total", kind="completion") == 1
    assert ("specgate_audit_write_failures_total", frozenset({("kind", "request")})) not in samples(
        metrics
    )
    labels = {"method": "draft", "model": "demo"}
    assert value(metrics, "specgate_fallback_switches_total", action="disabled", **labels) == 2
    assert value(metrics, "specgate_fallback_switches_total", action="enabled", **labels) == 1


def test_queue_depth_and_fallback_state_are_read_at_scrape_time() -> None:
    metrics = Metrics()
    state: dict[Method, bool] = {"ngram": False, "draft": False}
    depth = [0]
    metrics.watch_engine("demo", ("ngram", "draft"), lambda: depth[0], lambda: state)
    assert value(metrics, "specgate_queue_depth") == 0
    assert value(metrics, "specgate_speculation_disabled", method="draft", model="demo") == 0
    state["draft"] = True
    depth[0] = 5
    assert value(metrics, "specgate_queue_depth") == 5
    assert value(metrics, "specgate_speculation_disabled", method="draft", model="demo") == 1
    assert value(metrics, "specgate_speculation_disabled", method="ngram", model="demo") == 0


def test_each_app_has_its_own_registry() -> None:
    first, second = Metrics(), Metrics()
    first.observe_request("/v1/models", 200, 0.01)
    assert value(first, "specgate_requests_total", route="/v1/models", status="200") == 1
    assert (
        "specgate_requests_total",
        frozenset({("route", "/v1/models"), ("status", "200")}),
    ) not in (samples(second))


@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8)), min_size=1, max_size=20))
def test_accepted_tokens_per_position_count_the_accepted_runs(
    steps: list[tuple[int, int]],
) -> None:
    stats = GenerationStats(method="medusa")
    for proposed, accepted in steps:
        stats.record_step(proposed, min(accepted, proposed))
    metrics = Metrics()
    metrics.observe_generation("demo", stats)
    accepted = [min(a, p) for p, a in steps]
    for position in range(max(accepted)):
        labels = {"method": "medusa", "model": "demo", "position": str(position)}
        expected = sum(a > position for a in accepted)
        name = "specgate_spec_decode_num_accepted_tokens_per_pos_total"
        assert value(metrics, name, **labels) == expected
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
