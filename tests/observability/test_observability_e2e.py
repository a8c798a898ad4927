"""Observability through the real app: a live server, real PostgreSQL, a real OTLP receiver.

The draft is a random model and the engine switches a method off below 99 % acceptance
over 8 draft tokens, so the first speculative request already triggers a fallback switch.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
import typer
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from gateway.app import create_app
from gateway.cli_serve import serve
from gateway.observability.egress import EgressRefusedError
from gateway.observability.logging import configure_logging, reset_logging
from gateway.settings import Settings
from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_receiver
from tests.tiny_models import build_pair

MODEL = "target"
CANARY = "CANARY-b7e1d94f-do-not-export"


@pytest.fixture(scope="module")
def logs() -> Iterator[io.StringIO]:
    out = io.StringIO()
    configure_logging(log_format="json", level="debug", stream=out)
    yield out
    reset_logging()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_receiver() as running:
        yield running


@pytest.fixture(scope="module")
def live(
    tmp_path_factory: pytest.TempPathFactory, logs: io.StringIO, receiver: OtlpReceiver
) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("observability")
    models = build_pair(root / "models")
    with fresh_database() as (name, url):
        # A fallback switch after a few requests: the random draft is rarely accepted.
        settings = gateway_settings(
            models,
            root / "data",
            url,
            otlp_endpoint=receiver.endpoint,
            acceptance_threshold=0.99,
            fallback_window_tokens=8,
        )
        with live_gateway(settings, name) as running:
            yield running


def chat(live: LiveGateway, content: str, **extra: Any) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 7,
        "speculative": {"method": "draft", "num_speculative_tokens": 4},
        **extra,
    }
    response = httpx.post(
        live.base_url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {live.keys['app']}"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response


def flush(live: LiveGateway) -> None:
    tracing = live.services.telemetry.tracing
    assert tracing is not None
    assert tracing.force_flush()


def metric_samples(live: LiveGateway) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    response = httpx.get(live.base_url + "/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def spec_value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> float:
    return samples.get((name, frozenset({("method", "draft"), ("model", MODEL)})), 0.0)


def trace_of(receiver: OtlpReceiver, response_id: str) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    """The GenAI span that answered ``response_id`` and every span of its trace."""
    (genai,) = [
        s
        for s in receiver.named(f"chat {MODEL}")
        if s.attributes.get("gen_ai.response.id") == response_id
    ]
    return genai, [s for s in receiver.spans if s.trace_id == genai.trace_id]


def test_a_completion_is_traced_from_http_span_to_engine_spans(
    live: LiveGateway, receiver: OtlpReceiver
) -> None:
    response = chat(live, f"hello {CANARY}")
    body = response.json()
    flush(live)
    genai, spans = trace_of(receiver, body["id"])
    by_name: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)

    (server,) = by_name["POST /v1/chat/completions"]
    assert server.kind == ProtoSpan.SPAN_KIND_SERVER
    assert genai.parent_span_id == server.span_id
    assert genai.kind == ProtoSpan.SPAN_KIND_INTERNAL
    spec = body["speculative"]
    assert spec["num_draft_tokens"] > 0
    expected = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "specgate",
        "gen_ai.request.model": MODEL,
        "gen_ai.request.seed": 7,
        "gen_ai.request.max_tokens": 12,
        "gen_ai.request.temperature": 1.0,
        "gen_ai.request.top_p": 1.0,
        "gen_ai.response.model": MODEL,
        "gen_ai.response.id": body["id"],
        "gen_ai.response.finish_reasons": [body["choices"][0]["finish_reason"]],
        "gen_ai.usage.input_tokens": body["usage"]["prompt_tokens"],
        "gen_ai.usage.output_tokens": body["usage"]["completion_tokens"],
        "specgate.speculative.method": "draft",
        "specgate.speculative.num_drafts": spec["num_drafts"],
        "specgate.speculative.num_draft_tokens": spec["num_draft_tokens"],
        "specgate.speculative.num_accepted_tokens": spec["num_accepted_tokens"],
        "specgate.speculative.acceptance_rate": spec["acceptance_rate"],
        "specgate.speculative.mean_acceptance_length": spec["mean_acceptance_length"],
        "specgate.speculative.fallback_active": spec["fallback_active"],
    }
    assert {k: genai.attributes[k] for k in expected} == expected
    assert "gen_ai.input.messages" not in genai.attributes

    for name in ("specgate.prefill", "specgate.decode"):
        (engine_span,) = by_name[name]
        assert engine_span.parent_span_id == genai.span_id
    (decode,) = by_name["specgate.decode"]
    assert decode.attributes["specgate.speculative.num_draft_tokens"] == spec["num_draft_tokens"]
    assert (
        decode.attributes["specgate.speculative.num_accepted_tokens"] == spec["num_accepted_tokens"]
    )

    audit_kinds = {s.attributes["specgate.audit.kind"] for s in by_name["specgate.audit.append"]}
    assert {"request", "completion"} <= audit_kinds
    assert all(s.parent_span_id == genai.span_id for s in by_name["specgate.audit.append"])
    request_audit = next(
        s
        for s in by_name["specgate.audit.append"]
        if s.attributes["specgate.audit.kind"] == "request"
    )
    assert (
        request_audit.attributes["specgate.audit.event_id"]
        == response.headers["x-specgate-audit-id"]
    )


def test_a_streamed_completion_gets_the_same_span(
    live: LiveGateway, receiver: OtlpReceiver
) -> None:
    response = chat(live, "stream please", stream=True, stream_options={"include_usage": True})
    chunks = [
        json.loads(line[len("data: ") :])
        for line in response.text.splitlines()
        if line.startswith("data: {")
    ]
    usage = chunks[-1]["usage"]
    flush(live)
    genai, spans = trace_of(receiver, chunks[0]["id"])
    assert genai.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    engine_spans = [s for s in spans if s.name in ("specgate.prefill", "specgate.decode")]
    assert [s.parent_span_id for s in engine_spans] == [genai.span_id, genai.span_id]


def test_log_lines_of_a_request_carry_its_request_and_trace_id(
    live: LiveGateway, receiver: OtlpReceiver, logs: io.StringIO
) -> None:
    response = chat(live, "which ids do my log lines carry?")
    request_id = response.headers["x-request-id"]
    flush(live)
    genai, _ = trace_of(receiver, response.json()["id"])
    lines = [json.loads(line) for line in logs.getvalue().splitlines()]
    mine = [line for line in lines if line.get("request_id") == request_id]
    assert any(line["event"] == "request finished" for line in mine)
    assert all(line["trace_id"] == genai.trace_id for line in mine)
    finished = next(line for line in mine if line["event"] == "request finished")
    assert (finished["route"], finished["status"]) == ("/v1/chat/completions", 200)


def test_a_client_request_id_is_kept(live: LiveGateway) -> None:
    response = httpx.get(
        live.base_url + "/v1/models",
        headers={"authorization": f"Bearer {live.keys['app']}", "x-request-id": "client-id-42"},
        timeout=30,
    )
    assert response.headers["x-request-id"] == "client-id-42"


def test_metrics_reflect_draft_and_accepted_tokens_and_the_fallback_switch(
    live: LiveGateway, receiver: OtlpReceiver
) -> None:
    before = metric_samples(live)
    spec = chat(live, "count my draft tokens").json()["speculative"]
    after = metric_samples(live)
    for name, figure in (
        ("specgate_spec_decode_num_draft_tokens_total", "num_draft_tokens"),
        ("specgate_spec_decode_num_accepted_tokens_total", "num_accepted_tokens"),
        ("specgate_spec_decode_num_drafts_total", "num_drafts"),
    ):
        assert spec_value(after, name) - spec_value(before, name) == spec[figure]
    assert spec["num_draft_tokens"] > 0
    route = frozenset({("route", "/v1/chat/completions"), ("status", "200")})
    assert (
        after[("specgate_requests_total", route)] - before[("specgate_requests_total", route)] == 1
    )

    disabled = frozenset({("method", "draft"), ("model", MODEL), ("action", "disabled")})
    assert after[("specgate_fallback_switches_total", disabled)] >= 1
    assert (
        after[("specgate_speculation_disabled", frozenset({("method", "draft"), ("model", MODEL)}))]
        == 1
    )
    assert (
        after[("specgate_speculation_disabled", frozenset({("method", "ngram"), ("model", MODEL)}))]
        == 0
    )
    assert after[("specgate_queue_depth", frozenset())] == 0
    assert (
        after[("specgate_audit_write_duration_seconds_count", frozenset({("kind", "fallback")}))]
        >= 1
    )
    assert (
        after[("specgate_audit_write_duration_seconds_count", frozenset({("kind", "completion")}))]
        >= 1
    )
    assert after[("specgate_time_to_first_token_seconds_count", frozenset({("model", MODEL)}))] >= 1

    flush(live)
    fallback_events = [
        attributes
        for span in receiver.spans
        for name, attributes in span.events
        if name == "specgate.fallback"
    ]
    assert fallback_events[0]["specgate.fallback.method"] == "draft"
    assert fallback_events[0]["specgate.fallback.action"] == "disabled"
    assert fallback_events[0]["specgate.fallback.threshold"] == 0.99


def test_the_canary_reaches_no_span_no_log_line_and_no_metric(
    live: LiveGateway, receiver: OtlpReceiver, logs: io.StringIO
) -> None:
    chat(live, f"one more time {CANARY}")
    flush(live)
    assert receiver.bodies
    assert not [body for body in receiver.bodies if CANARY.encode() in body]
    assert CANARY not in logs.getvalue()
    assert live.keys["app"] not in logs.getvalue()
    assert CANARY not in httpx.get(live.base_url + "/metrics", timeout=30).text


def test_startup_refuses_a_public_otlp_endpoint(tmp_path: Path) -> None:
    settings = Settings(
        target=tmp_path, otlp_endpoint="https://otlp.example.com:4318", data_dir=tmp_path
    )
    with pytest.raises(
        EgressRefusedError, match=re.escape("otlp_endpoint 'https://otlp.example.com:4318'")
    ):
        create_app(settings)


def test_serve_stops_on_a_public_otel_variable(tmp_path: Path) -> None:
    models = build_pair(tmp_path / "models")
    cli = typer.Typer()
    cli.command()(serve)
    result = CliRunner().invoke(
        cli,
        ["--target", str(models[0]), "--draft", str(models[1])],
        env={
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://ingest.example.net/v1/traces",
            "SPECGATE_DATA_DIR": str(tmp_path / "data"),
        },
    )
    reset_logging()
    structlog.contextvars.clear_contextvars()
    assert result.exit_code == 2
    assert "egress refused for OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in result.output
    assert "'ingest.example.net' is a name outside the cluster" in result.output
