"""What goes over the wire to a vLLM OpenAI-compatible server, and what comes back.

The gateway renders and tokenizes itself (through the server's ``/tokenize``), so every
generation is sent to ``/v1/completions`` as token ids, streamed, with the token ids of each
piece returned (``return_token_ids``) and the usage chunk at the end, where vLLM puts its
per-request speculative figures when it was started with ``--per-request-spec-decode-metrics``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.types import Constraint, FinishReason, GenerationRequest, InvalidRequestError

# vLLM's Prometheus counters of speculative decoding (the ``_total`` suffix is the
# exposition format's; ``_per_pos`` carries a ``position`` label).
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFaN]+)")


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
    }
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


def refuse_unsupported(request: GenerationRequest) -> None:
    """Log-probabilities are refused (400): the stream parser does not carry them yet, and an
    answer silently without them would be wrong."""
    if request.sampling.logprobs is not None:
        raise InvalidRequestError(
            "logprobs are not available through the vLLM backend yet", param="logprobs"
        )


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


class WireError(Exception):
    """The server answered something that is not a completion stream."""


def parse_event(line: str) -> Piece | None:
    """A ``data: ...`` line of the stream as a Piece; None for ``[DONE]`` and blank lines."""
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
    return Piece(
        text=choice.get("text") or "",
        token_ids=tuple(choice.get("token_ids") or ()),
        finish_reason=finish,
    )


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
