"""The GenAI span of one completion, per the OpenTelemetry GenAI semantic conventions.

The span is named ``{gen_ai.operation.name} {gen_ai.request.model}`` (``chat specgate-demo``)
and is INTERNAL: the model runs in this process. Message content
(``gen_ai.input.messages`` / ``gen_ai.output.messages``) is recorded only when the
operator turns ``trace_content`` on, as the conventions ask. Errors are recorded by type
only (``error.type``): an exception message might quote the request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from engine.api.types import FigureValue, GenerationStats, SamplingParams

PROVIDER_NAME = "specgate"


@dataclass
class CompletionSpan:
    """The running GenAI span. It is not made current on creation: a completion's work is
    spread over a route handler and a streamed body, so each part runs under
    :meth:`activate`, and :meth:`end` closes the span once the completion is recorded."""

    span: Span
    capture_content: bool

    @contextmanager
    def activate(self) -> Iterator[None]:
        """Make the span current, so that engine and audit spans started inside are children."""
        with trace.use_span(
            self.span, end_on_exit=False, record_exception=False, set_status_on_exception=False
        ):
            yield

    def record_result(
        self,
        *,
        response_id: str,
        response_model: str,
        finish_reasons: Sequence[str],
        stats: GenerationStats,
        output_texts: Sequence[str] | None = None,
    ) -> None:
        self.span.set_attributes(
            {
                "gen_ai.response.id": response_id,
                "gen_ai.response.model": response_model,
                "gen_ai.response.finish_reasons": list(finish_reasons),
                "gen_ai.usage.input_tokens": stats.num_prompt_tokens,
                "gen_ai.usage.output_tokens": stats.num_output_tokens,
                **speculative_attributes(stats),
            }
        )
        if self.capture_content and output_texts is not None:
            self.span.set_attribute(
                "gen_ai.output.messages", output_messages_attribute(output_texts, finish_reasons)
            )

    def record_error(self, error_type: str) -> None:
        """Mark the span failed; ``error_type`` is a class of error, never a message."""
        self.span.set_attribute("error.type", error_type)
        self.span.set_status(Status(StatusCode.ERROR, error_type))

    def end(self) -> None:
        self.span.end()


def speculative_attributes(stats: GenerationStats) -> dict[str, FigureValue]:
    """The engine's per-request speculation figures as ``specgate.speculative.*`` attributes
    (``engine.api.types.SPECULATION_FIGURES``), with the time to the first token."""
    return {
        **stats.span_attributes(),
        "specgate.time_to_first_token_s": stats.time_to_first_token_s,
    }


def request_attributes(operation: str, model: str, sampling: SamplingParams) -> dict[str, object]:
    attributes: dict[str, object] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER_NAME,
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": sampling.max_tokens,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
    }
    if sampling.top_k:
        attributes["gen_ai.request.top_k"] = sampling.top_k
    if sampling.seed is not None:
        attributes["gen_ai.request.seed"] = sampling.seed
    if sampling.presence_penalty:
        attributes["gen_ai.request.presence_penalty"] = sampling.presence_penalty
    if sampling.frequency_penalty:
        attributes["gen_ai.request.frequency_penalty"] = sampling.frequency_penalty
    if sampling.repetition_penalty != 1.0:
        attributes["specgate.request.repetition_penalty"] = sampling.repetition_penalty
    if sampling.logit_bias:
        attributes["specgate.request.logit_bias_tokens"] = len(sampling.logit_bias)
    if sampling.min_tokens:
        attributes["specgate.request.min_tokens"] = sampling.min_tokens
    if sampling.logprobs is not None:
        attributes["specgate.request.top_logprobs"] = sampling.logprobs
    if sampling.constraint is not None:
        kind = sampling.constraint.kind
        attributes["gen_ai.output.type"] = "json" if kind.startswith("json") else "text"
        attributes["specgate.request.constraint"] = kind
    return attributes


def input_messages_attribute(messages: Sequence[Mapping[str, object]]) -> str:
    """OpenAI-style ``{"role", "content"}`` messages in the GenAI ``parts`` form, as JSON."""
    return json.dumps(
        [
            {
                "role": m.get("role", "user"),
                "parts": [{"type": "text", "content": m.get("content")}],
            }
            for m in messages
        ]
    )


def output_messages_attribute(texts: Sequence[str], finish_reasons: Sequence[str]) -> str:
    """One assistant message per choice in the GenAI ``parts`` form, as JSON."""
    return json.dumps(
        [
            {
                "role": "assistant",
                "parts": [{"type": "text", "content": text}],
                "finish_reason": reason,
            }
            for text, reason in zip(texts, finish_reasons, strict=False)
        ]
    )


def start_completion_span(
    tracer: trace.Tracer,
    *,
    operation: str,
    model: str,
    sampling: SamplingParams,
    input_messages: Sequence[Mapping[str, object]] | None = None,
    capture_content: bool = False,
) -> CompletionSpan:
    """Start the GenAI span as a child of the current span (the HTTP server span).

    ``operation`` is ``chat`` or ``text_completion``; ``input_messages`` reach the span
    only with ``capture_content``.
    """
    attributes = request_attributes(operation, model, sampling)
    if capture_content and input_messages is not None:
        attributes["gen_ai.input.messages"] = input_messages_attribute(input_messages)
    span = tracer.start_span(
        f"{operation} {model}",
        kind=SpanKind.INTERNAL,
        attributes=attributes,  # type: ignore[arg-type]
        record_exception=False,
        set_status_on_exception=False,
    )
    return CompletionSpan(span=span, capture_content=capture_content)
