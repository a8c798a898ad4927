"""The one object the app talks to for telemetry: egress check, tracing, metrics, spans.

``Telemetry.start(settings)`` runs the egress guard over every outbound URL before anything
is exported, then installs tracing if it is configured. The app then calls
:meth:`Telemetry.instrument` once, :meth:`watch_backends` once the backends are loaded, opens
each completion's GenAI span with :meth:`start_completion`, and appends audit events through
:class:`gateway.observability.audit.ObservedAuditLog`, which wraps each in :meth:`audit_write`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from engine.api.types import FallbackEvent, GenerationStats, SamplingParams
from gateway import specgate_version
from gateway.observability.egress import (
    EgressAllowed,
    EgressAllowlist,
    check_urls,
    exporter_endpoints_from_environment,
)
from gateway.observability.genai import CompletionSpan, start_completion_span
from gateway.observability.metrics import METRICS_CONTENT_TYPE, Metrics
from gateway.observability.middleware import RequestTelemetryMiddleware
from gateway.observability.tracing import OtlpProtocol, Tracing, resolve_tracing, tracer

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.responses import Response

    from gateway.backends.base import GenerationBackend

METRICS_PATH = "/metrics"
# Paths that get no HTTP server span: scrapes and probes would drown the traces.
UNTRACED_PATHS = ("/metrics", "/healthz", "/readyz", "/livez", "/health", "/version")

_log = structlog.get_logger("specgate.telemetry")


class TelemetrySettings(Protocol):
    """The fields of :class:`gateway.settings.Settings` that telemetry reads."""

    otlp_endpoint: str | None
    otlp_protocol: OtlpProtocol | None
    trace_content: bool
    metrics_vllm_names: bool
    egress_allowlist: list[str]

    def outbound_backend_urls(self) -> dict[str, str]: ...


def check_egress(settings: TelemetrySettings, environ: Mapping[str, str]) -> list[EgressAllowed]:
    """Check every outbound URL (Specgate's ``otlp_endpoint``, ``OTEL_EXPORTER_*ENDPOINT``
    and the backend's servers).

    Raises :class:`~gateway.observability.egress.EgressRefusedError` on the first refusal.
    """
    urls = exporter_endpoints_from_environment(environ)
    if settings.otlp_endpoint:
        urls["otlp_endpoint"] = settings.otlp_endpoint
    urls.update(settings.outbound_backend_urls())
    return check_urls(urls, EgressAllowlist.parse(settings.egress_allowlist))


@dataclass
class CompletionTelemetry:
    """A running completion: its GenAI span, and the metrics its result is counted in."""

    span: CompletionSpan
    metrics: Metrics

    def activate(self) -> AbstractContextManager[None]:
        """Run a part of the completion (audit writes, engine submission) under its span."""
        return self.span.activate()

    def record_result(
        self,
        *,
        response_id: str,
        response_model: str,
        finish_reasons: Sequence[str],
        stats: GenerationStats,
        output_texts: Sequence[str] | None = None,
    ) -> None:
        self.span.record_result(
            response_id=response_id,
            response_model=response_model,
            finish_reasons=finish_reasons,
            stats=stats,
            output_texts=output_texts,
        )
        self.metrics.observe_generation(response_model, stats)

    def record_error(self, error_type: str) -> None:
        self.span.record_error(error_type)

    def end(self) -> None:
        self.span.end()


class AuditWriteSpan:
    """Lets the caller attach the appended event's sequence number and id to the span."""

    def __init__(self, span: trace.Span) -> None:
        self.span = span

    def record(self, seq: int, event_id: str) -> None:
        self.span.set_attributes({"specgate.audit.seq": seq, "specgate.audit.event_id": event_id})


class Telemetry:
    def __init__(self, metrics: Metrics, tracing: Tracing | None, *, capture_content: bool) -> None:
        self.metrics = metrics
        self.tracing = tracing
        self.capture_content = capture_content
        self.tracer = tracer()

    @classmethod
    def start(
        cls, settings: TelemetrySettings, environ: Mapping[str, str] | None = None
    ) -> Telemetry:
        """Check egress, then install tracing if configured. Raises before exporting anything."""
        env = os.environ if environ is None else environ
        allowed = check_egress(settings, env)
        target = resolve_tracing(settings.otlp_endpoint, settings.otlp_protocol, env)
        tracing = Tracing(target, service_version=specgate_version()) if target else None
        _log.info(
            "telemetry started",
            tracing=target is not None,
            otlp_protocol=target.protocol if target else None,
            egress=[f"{a.source} -> {a.host} ({a.rule})" for a in allowed],
        )
        return cls(
            Metrics(vllm_names=settings.metrics_vllm_names),
            tracing,
            capture_content=settings.trace_content,
        )

    def instrument(self, app: FastAPI) -> None:
        """Add the request middleware, the HTTP server span (if tracing) and ``GET /metrics``.

        ``/metrics`` is unauthenticated, as vLLM's is: its labels carry no request content.
        """
        app.add_middleware(RequestTelemetryMiddleware, metrics=self.metrics)
        app.add_api_route(
            METRICS_PATH, self.metrics_response, methods=["GET"], include_in_schema=False
        )
        if self.tracing is not None:
            from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

            FastAPIInstrumentor.instrument_app(
                app,
                excluded_urls=",".join(f"{path}$" for path in UNTRACED_PATHS),
                exclude_spans=["receive", "send"],
            )

    def metrics_response(self) -> Response:
        from starlette.responses import Response

        return Response(self.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    def watch_backends(self, backends: Sequence[GenerationBackend]) -> None:
        """Expose each backend's fallback state, and the requests all of them queue, as gauges
        read at scrape time."""

        def queue_depth() -> int:
            return sum(backend.queue_depth for backend in backends)

        for backend in backends:
            card = backend.card
            self.metrics.watch_engine(
                card.model_name,
                tuple(m for m in card.available_methods if m != "none"),
                queue_depth,
                backend.fallback_state,
                # Backends that batch with adaptive speculation report where it stops paying.
                backend.speculation_crossover,
            )

    def fallback_listener(
        self, then: Callable[[FallbackEvent], None]
    ) -> Callable[[FallbackEvent], None]:
        """The engine's ``on_fallback`` callback: telemetry first, then ``then`` (the audit)."""

        def listen(event: FallbackEvent) -> None:
            self.on_fallback(event)
            then(event)

        return listen

    def replica_listener(self, then: Callable[[Any], None]) -> Callable[[Any], None]:
        """A remote backend's replica listener: changes of rotation (`backend_replica`) counted
        in the metrics, then every event to ``then``."""

        def listen(event: Any) -> None:
            if event.kind == "backend_replica":
                self.metrics.observe_replica(event.url, event.pool, event.action)
            then(event)

        return listen

    def on_fallback(self, event: FallbackEvent) -> None:
        """Count a fallback switch, and note it on the current span (the engine's, if tracing).

        Called from the engine's worker thread.
        """
        self.metrics.observe_fallback(event)
        attributes = {
            f"specgate.fallback.{k}": v for k, v in event.as_dict().items() if v is not None
        }
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event("specgate.fallback", attributes)  # type: ignore[arg-type]
        else:
            with self.tracer.start_as_current_span("specgate.fallback") as own:
                own.add_event("specgate.fallback", attributes)  # type: ignore[arg-type]
        _log.warning("speculation fallback", **event.as_dict())

    def start_completion(
        self,
        *,
        operation: str,
        model: str,
        sampling: SamplingParams,
        input_messages: Sequence[Mapping[str, object]] | None = None,
    ) -> CompletionTelemetry:
        """Open the GenAI span of one completion; the caller ends it with ``end()``."""
        span = start_completion_span(
            self.tracer,
            operation=operation,
            model=model,
            sampling=sampling,
            input_messages=input_messages,
            capture_content=self.capture_content,
        )
        return CompletionTelemetry(span=span, metrics=self.metrics)

    @contextmanager
    def audit_write(self, kind: str) -> Iterator[AuditWriteSpan]:
        """Span and latency of one audit append; an exception counts as a failed write."""
        started = time.perf_counter()
        with self.tracer.start_as_current_span(
            "specgate.audit.append",
            kind=SpanKind.INTERNAL,
            attributes={"specgate.audit.kind": kind},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield AuditWriteSpan(span)
            except Exception as error:
                span.set_attribute("error.type", type(error).__name__)
                span.set_status(Status(StatusCode.ERROR, type(error).__name__))
                self.metrics.observe_audit_write(kind, time.perf_counter() - started, failed=True)
                raise
            self.metrics.observe_audit_write(kind, time.perf_counter() - started, failed=False)

    def shutdown(self) -> None:
        """Flush and stop exporting spans."""
        if self.tracing is not None:
            self.tracing.shutdown()
