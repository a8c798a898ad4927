"""One list of speculation figures (engine.api.types.SPECULATION_FIGURES): the response extension,
the `completion` audit event, both spans and the Prometheus counters report exactly these.
Each test fails if a consumer names a figure the list does not have or misses one."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from engine.api.types import SPECULATION_FIELDS, SPECULATION_FIGURES, GenerationStats
from engine.serving.scheduler import annotate
from gateway.generation.replies import speculative_usage
from gateway.observability.genai import speculative_attributes
from gateway.observability.metrics import Metrics
from gateway.privacy.commitments import CommitmentKey
from gateway.recording import combined_stats, completion_payload
from gateway.schemas import SpeculativeUsage

ROOT = Path(__file__).resolve().parents[2]
SPAN_PREFIX = "specgate.speculative."


def _stats(**changes: Any) -> GenerationStats:
    stats = GenerationStats(method="draft", num_prompt_tokens=5, num_output_tokens=9)
    for proposed, accepted in ((4, 3), (4, 0), (2, 2), (0, 0)):
        stats.record_step(proposed, accepted)
    return dataclasses.replace(stats, **changes)


def test_every_figure_is_a_field_or_property_of_the_stats() -> None:
    stats = _stats()
    for figure in SPECULATION_FIGURES:
        assert hasattr(stats, figure.name), figure.name
        if figure.kind in ("count", "per_position"):
            assert figure.name in {f.name for f in dataclasses.fields(GenerationStats)}
            assert figure.metric is not None
        else:
            assert figure.metric is None
    assert len(set(SPECULATION_FIELDS)) == len(SPECULATION_FIELDS)


def test_the_response_extension_has_exactly_the_figures() -> None:
    assert set(SpeculativeUsage.model_fields) == set(SPECULATION_FIELDS)
    usage = speculative_usage(_stats()).model_dump()
    assert usage == _stats().speculation()
    assert usage["num_accepted_tokens_per_pos"] == [2, 2, 1]


def test_the_completion_event_has_exactly_the_figures() -> None:
    key = CommitmentKey(b"k" * 32, {"type": "deployment", "kek_id": "sha256:x"})
    payload = completion_payload(
        request_event_id="e-1",
        outcome="ok",
        error=None,
        commitments=[key.commit(b"x")],
        commitment_key=key.description,
        schedules=[None],
        finish_reasons=["length"],
        prompt_tokens=5,
        completion_tokens=9,
        stats=_stats(),
        latency_s=0.1,
    )
    assert set(payload["speculative"]) == set(SPECULATION_FIELDS)
    assert payload["speculative"]["num_drafts"] == 3
    assert payload["speculative"]["acceptance_rate"] == 5 / 10


class _Span:
    def __init__(self) -> None:
        self.attributes: dict[str, Any] = {}

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self.attributes.update(attributes)


def _speculative_keys(attributes: dict[str, Any]) -> set[str]:
    return {k.removeprefix(SPAN_PREFIX) for k in attributes if k.startswith(SPAN_PREFIX)}


def test_both_spans_carry_exactly_the_figures() -> None:
    assert _speculative_keys(speculative_attributes(_stats())) == set(SPECULATION_FIELDS)
    span = _Span()
    annotate(span, _stats())  # type: ignore[arg-type]
    assert _speculative_keys(span.attributes) == set(SPECULATION_FIELDS)
    assert span.attributes[SPAN_PREFIX + "num_accepted_tokens"] == 5


def _value(registry: CollectorRegistry, name: str, labels: dict[str, str]) -> float:
    found = registry.get_sample_value(name + "_total", labels)
    return 0.0 if found is None else found


def test_every_counted_figure_is_a_counter_that_adds_the_request() -> None:
    metrics = Metrics()
    stats = _stats()
    metrics.observe_generation("m", stats)
    metrics.observe_generation("m", stats)
    labels = {"method": "draft", "model": "m"}
    counted = [f for f in SPECULATION_FIGURES if f.metric is not None]
    assert set(metrics.speculation_counters) == {f.name for f in counted}
    for figure in counted:
        assert figure.metric is not None
        value = getattr(stats, figure.name)
        if figure.kind == "per_position":
            for position, count in enumerate(value):
                at = {**labels, "position": str(position)}
                assert _value(metrics.registry, figure.metric, at) == 2 * count
        else:
            assert _value(metrics.registry, figure.metric, labels) == 2 * value


_steps = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=8)


@given(st.lists(_steps, min_size=1, max_size=4))
def test_choices_add_every_counted_figure(choices: list[list[tuple[int, int]]]) -> None:
    all_stats = []
    for steps in choices:
        stats = GenerationStats(method="ngram")
        for proposed, accepted in steps:
            stats.record_step(proposed, min(accepted, proposed))
        all_stats.append(stats)
    total = combined_stats(all_stats)
    assert total is not None
    for figure in SPECULATION_FIGURES:
        if figure.kind == "count":
            assert getattr(total, figure.name) == sum(getattr(s, figure.name) for s in all_stats)
        elif figure.kind == "per_position":
            rows = [s.num_accepted_tokens_per_pos for s in all_stats]
            width = max(len(row) for row in rows)
            expected = [sum(row[i] for row in rows if i < len(row)) for i in range(width)]
            assert total.num_accepted_tokens_per_pos == expected
    drafted = sum(s.num_draft_tokens for s in all_stats)
    accepted = sum(s.num_accepted_tokens for s in all_stats)
    assert total.acceptance_rate == (accepted / drafted if drafted else 0.0)


def test_no_source_names_a_speculative_attribute_the_list_does_not_have() -> None:
    pattern = re.compile(r"specgate\.speculative\.([a-z_]+)")
    for folder in ("engine", "gateway", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in pattern.findall(path.read_text()):
                assert name in SPECULATION_FIELDS, f"{path}: specgate.speculative.{name}"
