"""OpenTelemetry tracing: OTLP export over HTTP/protobuf or gRPC, off unless configured.

Tracing is on when Specgate's ``otlp_endpoint`` is set or when the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` variables are.
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` keep it off. Every other
``OTEL_*`` setting (headers, certificates, timeouts, compression, sampler, resource
attributes, service name) is read by the SDK and exporter as documented by OpenTelemetry.

OpenTelemetry allows one global tracer provider per process, and the engine's spans go
to the global one. So the provider is installed once, with a span processor whose
exporter each app swaps in at startup and out at shutdown; apps created one after the
other in one process (tests, benchmarks) each export to their own endpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

OtlpProtocol = Literal["http/protobuf", "grpc"]
OTLP_PROTOCOLS: tuple[OtlpProtocol, ...] = ("http/protobuf", "grpc")
SERVICE_NAME = "specgate"
TRACES_PATH = "/v1/traces"
TRACER_NAME = "specgate.gateway"


@dataclass(frozen=True)
class TracingTarget:
    """Where spans go. ``endpoint`` None lets the exporter follow the ``OTEL_*`` variables."""

    protocol: OtlpProtocol
    endpoint: str | None


def resolve_tracing(
    otlp_endpoint: str | None,
    otlp_protocol: OtlpProtocol | None,
    environ: Mapping[str, str],
) -> TracingTarget | None:
    """Decide from Specgate's settings and the ``OTEL_*`` variables whether and where to trace.

    ``otlp_endpoint`` is a base URL, like ``OTEL_EXPORTER_OTLP_ENDPOINT``: for HTTP,
    ``/v1/traces`` is appended unless the URL already ends with it.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporters = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if exporters == "none":
        return None
    if exporters != "otlp":
        raise ValueError(
            f"OTEL_TRACES_EXPORTER={exporters!r} is not supported; use 'otlp' or 'none'"
        )
    protocol = (
        otlp_protocol
        or (
            environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        ).strip()
    )
    if protocol not in OTLP_PROTOCOLS:
        raise ValueError(
            f"OTLP protocol {protocol!r} is not supported; use one of {', '.join(OTLP_PROTOCOLS)}"
        )
    resolved = cast(OtlpProtocol, protocol)
    if otlp_endpoint:
        endpoint = otlp_endpoint.strip()
        if protocol == "http/protobuf" and not endpoint.rstrip("/").endswith(TRACES_PATH):
            endpoint = endpoint.rstrip("/") + TRACES_PATH
        return TracingTarget(protocol=resolved, endpoint=endpoint)
    if environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    ):
        return TracingTarget(protocol=resolved, endpoint=None)
    return None


def build_exporter(target: TracingTarget) -> SpanExporter:
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        return GrpcSpanExporter(endpoint=target.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    return HttpSpanExporter(endpoint=target.endpoint)


class _SwappableSpanProcessor(SpanProcessor):
    """Forwards to the processor of the app that currently exports, or drops spans."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delegate: SpanProcessor | None = None

    def swap(
        self, delegate: SpanProcessor | None, *, expected: SpanProcessor | None = None
    ) -> None:
        with self._lock:
            if expected is None or self._delegate is expected:
                self._delegate = delegate

    def on_start(self, span: Span, parent_context: otel_context.Context | None = None) -> None:
        delegate = self._delegate
        if delegate is not None:
            delegate.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        delegate = self._delegate
        if delegate is not None:
            delegate.on_end(span)

    def shutdown(self) -> None:
        self.swap(None)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        delegate = self._delegate
        return delegate.force_flush(timeout_millis) if delegate is not None else True


_install_lock = threading.Lock()
_swappable: _SwappableSpanProcessor | None = None


def _process_span_processor(service_version: str) -> _SwappableSpanProcessor:
    """The process-wide swappable processor, on the global tracer provider."""
    global _swappable
    with _install_lock:
        if _swappable is None:
            _swappable = _SwappableSpanProcessor()
            provider = trace.get_tracer_provider()
            if not isinstance(provider, TracerProvider):
                detected = OTELResourceDetector().detect().attributes
                provider = TracerProvider(
                    resource=Resource.create(
                        {
                            "service.name": SERVICE_NAME,
                            "service.version": service_version,
                            **detected,
                        }
                    )
                )
                trace.set_tracer_provider(provider)
            provider.add_span_processor(_swappable)
        return _swappable


class Tracing:
    """One app's exporting pipeline; :meth:`shutdown` flushes it and stops exporting."""

    def __init__(self, target: TracingTarget, *, service_version: str) -> None:
        self.target = target
        self._processor = BatchSpanProcessor(build_exporter(target))
        self._switch = _process_span_processor(service_version)
        self._switch.swap(self._processor)

    def force_flush(self, timeout_millis: int = 5000) -> bool:
        return self._processor.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self._switch.swap(None, expected=self._processor)
        self._processor.shutdown()


def tracer() -> trace.Tracer:
    """The gateway's tracer (a no-op one while tracing is off)."""
    return trace.get_tracer(TRACER_NAME)
