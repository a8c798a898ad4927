"""Server-sent events of a streamed answer: OpenAI's chunks, tool-call deltas, the error chunk."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel

from engine.api.tool_parsers import (
    ArgumentsDelta,
    CallStarted,
    ToolCallReader,
    ToolEvent,
)
from engine.api.types import (
    TokenLogprob,
)
from gateway.backends.base import BackendCard
from gateway.errors import (
    APIError,
    error_body,
)
from gateway.generation.job import Job
from gateway.generation.replies import (
    chat_logprobs,
    completion_logprobs,
    tool_call_id,
    tool_finish,
)
from gateway.schemas import (
    SpeculativeUsage,
)


def system_fingerprint(card: BackendCard) -> str:
    """Changes whenever the target model's weights, config or tokenizer change."""
    return "fp_" + card.target_version.split(":")[-1][:12]


class StreamChunks:
    """Chunks in OpenAI's streaming shapes (``chat.completion.chunk``, ``text_completion``).
    With ``usage_so_far`` (vLLM's ``continuous_usage_stats``) every chunk carries the usage
    up to it; otherwise, where usage is asked for, ``usage: null`` until the last chunk."""

    def __init__(
        self,
        job: Job,
        card: BackendCard,
        usage_so_far: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.job = job
        self.include_usage = job.include_usage
        self.usage_so_far = usage_so_far
        self.base: dict[str, Any] = {
            "id": job.response_id,
            "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
            "created": job.created,
            "model": card.model_name,
            "system_fingerprint": system_fingerprint(card),
        }

    def choice(self, index: int, body: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": index, **body, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self.base, "choices": [choice]}
        if self.usage_so_far is not None:
            chunk["usage"] = self.usage_so_far()
        elif self.include_usage:
            chunk["usage"] = None
        return chunk

    def text(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: Sequence[TokenLogprob] | None = None,
        offset: int = 0,
    ) -> dict[str, Any]:
        if self.job.kind == "chat":
            chunk = self.choice(index, {"delta": {"content": text} if text else {}}, finish_reason)
            if logprobs is not None:
                chunk["choices"][0]["logprobs"] = _dump(chat_logprobs(logprobs))
            return chunk
        chunk = self.choice(index, {"text": text}, finish_reason)
        if logprobs is not None:
            chunk["choices"][0]["logprobs"] = _dump(completion_logprobs(logprobs, offset))
        return chunk

    def tool_deltas(
        self, index: int, reader: ToolCallReader, text: str, finish_reason: str | None
    ) -> list[dict[str, Any]]:
        """The chunks for a tool-enabled choice's next text: content that cannot be part of a
        call, a call's first delta (index, id, type, name, no arguments yet), its arguments'
        fragments as they are read; then the finish."""
        events = reader.feed(text)
        if finish_reason is not None:
            events += reader.finish()
        chunks = [self.choice(index, {"delta": _tool_delta(event)}, None) for event in events]
        if finish_reason is not None:
            finish = tool_finish(finish_reason) if reader.calls else finish_reason
            chunks.append(self.choice(index, {"delta": {}}, finish))
        return chunks

    def usage(self, usage: dict[str, int], speculative: SpeculativeUsage) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": usage, "speculative": speculative.model_dump()}


def _tool_delta(event: ToolEvent) -> dict[str, Any]:
    if isinstance(event, CallStarted):
        call = {"id": tool_call_id(), "type": "function"}
        return {
            "tool_calls": [
                {"index": event.index, **call, "function": {"name": event.name, "arguments": ""}}
            ]
        }
    if isinstance(event, ArgumentsDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    return {"content": event.text}


def _dump(value: BaseModel | None) -> Any:
    return None if value is None else value.model_dump(mode="json")


def error_chunk(error: APIError) -> dict[str, Any]:
    return error_body(error.message, error.type, error.param, error.code)


def sse(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
