"""The pieces of an OpenAI response: usage, the chat message (with its tool calls), logprobs."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from engine.api.types import (
    GenerationStats,
    TokenLogprob,
)
from gateway.generation.job import Job
from gateway.schemas import (
    ChoiceLogprobs,
    CompletionLogprobs,
    FunctionCall,
    ResponseMessage,
    SpeculativeUsage,
    TokenLogprobInfo,
    ToolCall,
    TopLogprob,
)


def speculative_usage(stats: GenerationStats) -> SpeculativeUsage:
    return SpeculativeUsage.model_validate(stats.speculation())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_message(job: Job, text: str, finish_reason: str) -> tuple[ResponseMessage, str]:
    """The assistant message for a choice's text, its tool calls parsed out (then the finish
    reason is ``tool_calls``)."""
    if job.tools is None:
        return ResponseMessage(content=text), finish_reason
    parsed = job.tools.parse(text)
    if not parsed.calls:
        return ResponseMessage(content=parsed.content or ""), finish_reason
    calls = [
        ToolCall(id=tool_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
        for call in parsed.calls
    ]
    return ResponseMessage(content=parsed.content, tool_calls=calls), tool_finish(finish_reason)


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_finish(finish_reason: str) -> str:
    """A choice that made calls finishes with ``tool_calls``, unless it was cut short (then the
    last call's arguments are as far as they got, as OpenAI's are)."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _top(entry: TokenLogprob) -> list[TopLogprob]:
    return [TopLogprob(token=t, bytes=list(b), logprob=v) for t, b, v in entry.top]


def chat_logprobs(entries: Sequence[TokenLogprob] | None) -> ChoiceLogprobs | None:
    if entries is None:
        return None
    return ChoiceLogprobs(
        content=[
            TokenLogprobInfo(
                token=e.text, bytes=list(e.bytes), logprob=e.logprob, top_logprobs=_top(e)
            )
            for e in entries
        ]
    )


def completion_logprobs(
    entries: Sequence[TokenLogprob] | None, offset: int = 0
) -> CompletionLogprobs | None:
    """The legacy shape; ``offset`` is where the first token's text starts in the output."""
    if entries is None:
        return None
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.text)
    return CompletionLogprobs(
        tokens=[e.text for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{t: v for t, _, v in e.top} for e in entries],
        text_offset=offsets,
    )
