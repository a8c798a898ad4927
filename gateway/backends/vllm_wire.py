"""What goes over the wire to a vLLM OpenAI-compatible server, and what comes back.

The gateway renders and tokenizes itself (through the server's ``/tokenize``), so every
generation is sent to ``/v1/completions`` as token ids, streamed, with the token ids of each
piece returned (``return_token_ids``) and the usage chunk at the end, where vLLM puts its
per-request speculative figures when it was started with ``--per-request-spec-decode-metrics``.

Log-probabilities come back in the legacy completions shape (``tokens``, ``token_logprobs``,
``top_logprobs`` as a text-to-logprob map holding the chosen token besides the top ones); they
are turned into the ``TokenLogprob`` entries the built-in engine gives, so the gateway answers
both in the same chat and completions schema. The values are vLLM's own, as its
``--logprobs-mode`` makes them (docs/vllm.md).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from opentelemetry import propagate

from engine.api.types import (
    Constraint,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    TokenLogprob,
)

# vLLM's Prometheus counters of speculative decoding (the ``_total`` suffix is the
# exposition format's; ``_per_pos`` carries a ``position`` label).
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFaN]+)")
_POSITION = re.compile(r'position="(\d+)"')


def trace_headers() -> dict[str, str]:
    """The current OpenTelemetry context as W3C trace-context headers (``traceparent``,
    ``tracestate``), so that a trace continues into vLLM (its ``--otlp-traces-endpoint``);
    empty when nothing is traced."""
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers


def completion_body(model: str, request: GenerationRequest) -> dict[str, Any]:
    """The ``/v1/completions`` body for one generation, in vLLM's sampling terms."""
    sampling = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.prompt_ids),
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "ignore_eos": sampling.ignore_eos,
        "include_stop_str_in_output": sampling.include_stop_str_in_output,
        "skip_special_tokens": sampling.skip_special_tokens,
    }
    if sampling.logprobs is not None:
        body["logprobs"] = sampling.logprobs
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if request.request_id is not None:
        body["request_id"] = request.request_id
    body.update(_processors(request))
    return body


def _processors(request: GenerationRequest) -> dict[str, Any]:
    """The logits processors in vLLM's terms (its sampling parameters of the same names and
    ``structured_outputs``), only those a request turned on."""
    sampling = request.sampling
    fields: dict[str, Any] = {}
    if sampling.presence_penalty:
        fields["presence_penalty"] = sampling.presence_penalty
    if sampling.frequency_penalty:
        fields["frequency_penalty"] = sampling.frequency_penalty
    if sampling.repetition_penalty != 1.0:
        fields["repetition_penalty"] = sampling.repetition_penalty
    if sampling.logit_bias:
        fields["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias}
    if sampling.min_tokens:
        fields["min_tokens"] = sampling.min_tokens
    if sampling.min_p:
        fields["min_p"] = sampling.min_p
    if sampling.allowed_token_ids:
        fields["allowed_token_ids"] = list(sampling.allowed_token_ids)
    if sampling.bad_words:
        # vLLM takes bad words as text and tokenizes them itself, in more than one way.
        raise InvalidRequestError("bad_words is not served through a vLLM backend", "bad_words")
    if sampling.constraint is not None:
        fields["structured_outputs"] = structured_outputs(sampling.constraint)
    return fields


def structured_outputs(constraint: Constraint) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` object for one constraint."""
    if constraint.kind == "json_schema":
        return {"json": json.loads(constraint.spec)}
    if constraint.kind == "json_object":
        return {"json_object": True}
    if constraint.kind == "choice":
        return {"choice": json.loads(constraint.spec)}
    return {constraint.kind: constraint.spec}  # "regex", "grammar"


@dataclass(frozen=True)
class Piece:
    """One streamed chunk: text and token ids, or the finish, or the closing usage."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: dict[str, Any] | None = None
    speculative: dict[str, Any] | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


class WireError(Exception):
    """The server answered something that is not a completion stream."""


def parse_event(line: str, top_logprobs: int | None = None) -> Piece | None:
    """A ``data: ...`` line of the stream as a Piece; None for ``[DONE]`` and blank lines.
    ``top_logprobs``: how many alternatives the request asked for (None: no logprobs)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    try:
        chunk = json.loads(data)
    except ValueError as error:
        raise WireError(f"not JSON: {data[:200]!r}") from error
    if "error" in chunk and "choices" not in chunk:
        raise WireError(f"vLLM error: {chunk['error']}")
    choices = chunk.get("choices") or []
    if not choices:
        metrics = chunk.get("metrics") or {}
        return Piece(usage=chunk.get("usage"), speculative=metrics.get("speculative_decoding"))
    choice = choices[0]
    finish = choice.get("finish_reason")
    if finish not in (None, "stop", "length"):
        raise WireError(f"unexpected finish_reason {finish!r}")
    token_ids = tuple(choice.get("token_ids") or ())
    logprobs = None
    if top_logprobs is not None:
        logprobs = token_logprobs(choice.get("logprobs"), token_ids, top_logprobs)
    return Piece(
        text=choice.get("text") or "",
        token_ids=token_ids,
        finish_reason=finish,
        logprobs=logprobs,
    )


def token_logprobs(
    wire: dict[str, Any] | None, token_ids: tuple[int, ...], top: int
) -> tuple[TokenLogprob, ...]:
    """One chunk's legacy-shape logprobs as entries, one per token id, with the ``top`` most
    likely alternatives each (vLLM's map also holds the chosen token when it is not among
    them; OpenAI's chat shape lists exactly ``top``). ``bytes`` are the UTF-8 of vLLM's
    decoded token, as vLLM's own chat endpoint gives them."""
    if wire is None:
        if token_ids:
            raise WireError("logprobs were asked for and the chunk has none")
        return ()
    tokens = wire.get("tokens") or []
    values = wire.get("token_logprobs") or []
    tops = wire.get("top_logprobs") or [None] * len(tokens)
    if not len(tokens) == len(values) == len(tops) == len(token_ids):
        raise WireError(
            f"logprobs for {len(tokens)} tokens in a chunk of {len(token_ids)} token ids"
        )
    entries = []
    for token_id, text, value, alternatives in zip(token_ids, tokens, values, tops, strict=True):
        ranked = sorted((alternatives or {}).items(), key=lambda item: -item[1])[:top]
        entries.append(
            TokenLogprob(
                int(token_id),
                text,
                tuple(text.encode("utf-8", errors="replace")),
                float(value),
                tuple((t, tuple(t.encode("utf-8", errors="replace")), float(v)) for t, v in ranked),
            )
        )
    return tuple(entries)


def spec_counters(exposition: str) -> dict[str, float]:
    """The speculative-decoding counters of a ``/metrics`` page, summed over their labels
    (one engine per server here); a server without speculation has none."""
    totals: dict[str, float] = {}
    for line in exposition.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name = match.group(1).removesuffix("_total")
        if name in SPEC_COUNTERS:
            totals[name] = totals.get(name, 0.0) + float(match.group(3))
    return totals


def accepted_per_position(exposition: str) -> list[float]:
    """``vllm:spec_decode_num_accepted_tokens_per_pos`` of a ``/metrics`` page by position
    (entry i: steps that accepted a token at draft position i), summed over the other labels;
    empty on a server without speculation."""
    counts: dict[int, float] = {}
    for line in exposition.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1).removesuffix("_total") != ACCEPTED_PER_POSITION:
            continue
        position = _POSITION.search(match.group(2) or "")
        if position is not None:
            index = int(position.group(1))
            counts[index] = counts.get(index, 0.0) + float(match.group(3))
    return [counts.get(i, 0.0) for i in range(max(counts) + 1)] if counts else []
