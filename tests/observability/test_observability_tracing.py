"""Tracing setup: when it is on, where spans go (real OTLP receivers), and the GenAI span."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from engine.api.types import GenerationStats, SamplingParams
from gateway.observability.genai import start_completion_span
from gateway.observability.tracing import Tracing, TracingTarget, resolve_tracing, tracer
from tests.otlp_receiver import OtlpReceiver, otlp_receiver


@pytest.mark.parametrize(
    ("endpoint", "protocol", "environ", "expected"),
    [
        (None, None, {}, None),
        (
            "http://c.svc:4318",
            None,
            {},
            TracingTarget("http/protobuf", "http://c.svc:4318/v1/traces"),
        ),
        (
            "http://c.svc:4318/",
            None,
            {},
            TracingTarget("http/protobuf", "http://c.svc:4318/v1/traces"),
        ),
        (
            "http://c.svc:4318/v1/traces",
            None,
            {},
            TracingTarget("http/protobuf", "http://c.svc:4318/v1/traces"),
        ),
        ("http://c.svc:4317", "grpc", {}, TracingTarget("grpc", "http://c.svc:4317")),
        (
            "http://c.svc:4317",
            None,
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            TracingTarget("grpc", "http://c.svc:4317"),
        ),
        (
            None,
            None,
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c.svc:4318"},
            TracingTarget("http/protobuf", None),
        ),
        (
            None,
            None,
            {
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c.svc:4317",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
            },
            TracingTarget("grpc", None),
        ),
        ("http://c.svc:4318", None, {"OTEL_SDK_DISABLED": "true"}, None),
        ("http://c.svc:4318", None, {"OTEL_TRACES_EXPORTER": "none"}, None),
    ],
)
def test_tracing_is_off_unless_configured(
    endpoint: str | None,
    protocol: str | None,
    environ: dict[str, str],
    expected: TracingTarget | None,
) -> None:
    assert resolve_tracing(endpoint, protocol, environ) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin' is not supported"),
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTLP protocol 'http/json' is not supported",
        ),
    ],
)
def test_unsupported_exporters_are_errors(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_tracing("http://c.svc:4318", None, environ)


def _completion(receiver_tracing: Tracing, *, capture_content: bool, canary: str) -> None:
    span = start_completion_span(
        tracer(),
        operation="chat",
        model="specgate-demo",
        sampling=SamplingParams(max_tokens=8, temperature=0.5, top_p=0.9, seed=42),
        input_messages=[{"role": "user", "content": canary}],
        capture_content=capture_content,
    )
    with span.activate(), tracer().start_as_current_span("specgate.decode"):
        pass
    span.record_result(
        response_id="chatcmpl-1",
        response_model="specgate-demo",
        finish_reasons=["length"],
        stats=GenerationStats(
            method="draft",
            num_prompt_tokens=11,
            num_output_tokens=8,
            num_drafts=3,
            num_draft_tokens=12,
            num_accepted_tokens=6,
            num_target_passes=4,
        ),
        output_texts=[f"answer {canary}"],
    )
    span.end()
    assert receiver_tracing.force_flush()


def test_genai_span_reaches_a_real_otlp_http_receiver_without_content() -> None:
    canary = "CANARY-7f3a9c"
    with otlp_receiver() as receiver:
        tracing = Tracing(
            TracingTarget("http/protobuf", f"{receiver.endpoint}/v1/traces"), service_version="t"
        )
        try:
            _completion(tracing, capture_content=False, canary=canary)
        finally:
            tracing.shutdown()
        genai = receiver.wait_for("chat specgate-demo")
        decode = receiver.wait_for("specgate.decode")
    assert decode.parent_span_id == genai.span_id and decode.trace_id == genai.trace_id
    assert genai.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "specgate",
        "gen_ai.request.model": "specgate-demo",
        "gen_ai.request.max_tokens": 8,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.seed": 42,
        "gen_ai.response.id": "chatcmpl-1",
        "gen_ai.response.model": "specgate-demo",
        "gen_ai.response.finish_reasons": ["length"],
        "gen_ai.usage.input_tokens": 11,
        "gen_ai.usage.output_tokens": 8,
        "specgate.speculative.method": "draft",
        "specgate.speculative.num_drafts": 3,
        "specgate.speculative.num_draft_tokens": 12,
        "specgate.speculative.num_accepted_tokens": 6,
        "specgate.speculative.acceptance_rate": 0.5,
        "specgate.speculative.mean_acceptance_length": 3.0,
        "specgate.speculative.num_accepted_tokens_per_pos": [],
        "specgate.speculative.num_target_passes": 4,
        "specgate.speculative.fallback_active": False,
        "specgate.speculative.acceptance_source": "engine",
        "specgate.time_to_first_token_s": 0.0,
    }
    assert genai.resource["service.name"] == "specgate"
    assert all(canary.encode() not in body for body in receiver.bodies)


def test_message_content_is_recorded_only_when_opted_in() -> None:
    with otlp_receiver() as receiver:
        tracing = Tracing(
            TracingTarget("http/protobuf", f"{receiver.endpoint}/v1/traces"), service_version="t"
        )
        try:
            _completion(tracing, capture_content=True, canary="hello")
        finally:
            tracing.shutdown()
        genai = receiver.wait_for("chat specgate-demo")
    assert json.loads(genai.attributes["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": "hello"}]}
    ]
    assert json.loads(genai.attributes["gen_ai.output.messages"]) == [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": "answer hello"}],
            "finish_reason": "length",
        }
    ]


class _GrpcTraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.receiver.add(request.SerializeToString())
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def grpc_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_GrpcTraceService(receiver), server)
    receiver.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver
    server.stop(grace=None)


def test_spans_reach_a_real_otlp_grpc_receiver(grpc_receiver: OtlpReceiver) -> None:
    tracing = Tracing(TracingTarget("grpc", grpc_receiver.endpoint), service_version="t")
    try:
        with tracer().start_as_current_span("grpc-probe"):
            pass
        assert tracing.force_flush()
    finally:
        tracing.shutdown()
    assert grpc_receiver.wait_for("grpc-probe").resource["service.name"] == "specgate"


def test_an_app_that_shut_down_exports_nothing_more() -> None:
    with otlp_receiver() as first, otlp_receiver() as second:
        tracing = Tracing(
            TracingTarget("http/protobuf", f"{first.endpoint}/v1/traces"), service_version="t"
        )
        with tracer().start_as_current_span("to-first"):
            pass
        tracing.shutdown()
        later = Tracing(
            TracingTarget("http/protobuf", f"{second.endpoint}/v1/traces"), service_version="t"
        )
        try:
            with tracer().start_as_current_span("to-second"):
                pass
            assert later.force_flush()
        finally:
            later.shutdown()
        assert [s.name for s in first.spans] == ["to-first"]
        assert [s.name for s in second.spans] == ["to-second"]
