"""OpenAI's Responses API served by translation to the chat-completion path.

A request becomes the ``ChatCompletionRequest`` it means (``instructions`` a system message,
input items messages, ``function_call`` items an assistant turn's ``tool_calls``,
``function_call_output`` items tool messages, ``text.format`` the ``response_format``), so
templating, speculation, tools, structured outputs and the audit events are exactly the chat
completion's: the `request` event records the route ``/v1/chat/completions`` and, where
content is stored, the translated messages. The answer is rendered back as a Response
object; a stream's chat chunks become the Responses API's events.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from gateway.errors import APIError
from gateway.generation.audited import AuditedGeneration
from gateway.generation.job import Job
from gateway.generation.replies import chat_message
from gateway.responses_schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    MessageItem,
    ResponseRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
)
from gateway.schemas import ChatCompletionRequest, SpeculativeUsage

# Chat parameters named in errors, and the Responses parameter each one came from.
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def chat_request(body: ResponseRequest) -> ChatCompletionRequest:
    """The chat completion ``body`` asks for; 400 for what a stateless server cannot do."""
    if body.previous_response_id is not None:
        raise APIError(
            400,
            "Responses are not stored on this server, so previous_response_id cannot be "
            "resolved; send the whole conversation as input instead.",
            param="previous_response_id",
        )
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        "stream": body.stream,
        "user": body.user,
        "speculative": body.speculative,
        "store_content": body.store_content,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.stream:
        chat["stream_options"] = {"include_usage": True}  # for the final usage
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.temperature is not None:
        chat["temperature"] = body.temperature
    if body.top_p is not None:
        chat["top_p"] = body.top_p
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]
    if isinstance(body.tool_choice, FunctionToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, TextFormatJsonObject):
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, TextFormatJsonSchema):
        schema = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as error:  # e.g. a tool_choice naming no tool
        detail = error.errors()[0]
        where = str(detail["loc"][0]) if detail["loc"] else None
        param = _PARAMS.get(where, where) if where else None
        raise APIError(400, detail["msg"], param=param) from error


def _messages(body: ResponseRequest) -> list[dict[str, Any]]:
    """Chat messages in order; a reply's ``function_call`` items (after its text, if any)
    join one assistant turn."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else []
    for item in items or body.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


@contextmanager
def responses_params() -> Iterator[None]:
    """Errors raised on the chat path name the Responses parameter the client sent."""
    try:
        yield
    except APIError as error:
        error.param = _PARAMS.get(error.param or "", error.param)
        raise


def response_id(job: Job) -> str:
    return f"resp_{job.request_id}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": _item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def function_call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _usage(usage: dict[str, int]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_object(
    body: ResponseRequest,
    job: Job,
    model: str,
    *,
    status: str = "in_progress",
    output: list[dict[str, Any]] | None = None,
    incomplete: dict[str, str] | None = None,
    usage: dict[str, int] | None = None,
    speculative: SpeculativeUsage | dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Response object; the request's settings echoed, ``store`` always false."""
    tool_choice: Any = body.tool_choice or "auto"
    if isinstance(tool_choice, FunctionToolChoice):
        tool_choice = tool_choice.model_dump()
    fmt = body.text.format if body.text is not None else None
    sampling = job.sampling[0]
    response: dict[str, Any] = {
        "id": response_id(job),
        "object": "response",
        "created_at": job.created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": output or [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "store": False,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "text": {"format": {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True)},
        "tool_choice": tool_choice,
        "tools": [tool.model_dump() for tool in body.tools or []],
        "truncation": "disabled",
        "usage": None if usage is None else _usage(usage),
        "user": body.user,
        "metadata": body.metadata or {},
    }
    if speculative is not None:
        response["speculative"] = (
            speculative.model_dump() if isinstance(speculative, SpeculativeUsage) else speculative
        )
    return response


def completed_response(
    body: ResponseRequest, generation: AuditedGeneration, text: str, finish_reason: str
) -> dict[str, Any]:
    """The non-streaming answer for the one choice's ``text``."""
    job = generation.job
    message, _ = chat_message(job, text, finish_reason)
    output = []
    if message.content or not message.tool_calls:
        output.append(message_item(message.content or ""))
    for call in message.tool_calls or []:
        output.append(function_call_item(call.id, call.function.name, call.function.arguments))
    status, incomplete = _status(finish_reason)
    return response_object(
        body,
        job,
        generation.backend.card.model_name,
        status=status,
        output=output,
        incomplete=incomplete,
        usage=generation.usage(),
        speculative=generation.speculative(),
    )


class ResponseEvents:
    """The Responses API's stream events for one choice's chat chunks, in order: a message
    item opened at the first text and closed when a call starts or the choice ends, a
    ``function_call`` item per call with its arguments' deltas, then ``response.completed``
    (``response.incomplete`` when the output budget ran out), each numbered."""

    def __init__(self, body: ResponseRequest, job: Job, model: str) -> None:
        self.body, self.job, self.model = body, job, model
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.message: int | None = None  # the output index of the open message item
        self.calls: dict[int, int] = {}  # a chat call's index -> its output index
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"

    def _response(self, status: str, **fields: Any) -> dict[str, Any]:
        return response_object(self.body, self.job, self.model, status=status, **fields)

    def started(self) -> list[str]:
        response = self._response("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def _open_message(self) -> list[str]:
        """Added as OpenAI adds it: the item with no content, then its one text part."""
        self.message = len(self.output)
        item = message_item("", status="in_progress")
        self.output.append(item)
        place = {"output_index": self.message}
        return [
            self._event("response.output_item.added", item={**item, "content": []}, **place),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                content_index=0,
                part=item["content"][0],
                **place,
            ),
        ]

    def _text(self, delta: str) -> list[str]:
        events = [] if self.message is not None else self._open_message()
        assert self.message is not None
        item = self.output[self.message]
        item["content"][0]["text"] += delta
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=self.message,
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        )
        return events

    def _close_message(self) -> list[str]:
        if self.message is None:
            return []
        index, self.message = self.message, None
        item = self.output[index]
        item["status"] = "completed"
        part = item["content"][0]
        place = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", text=part["text"], logprobs=[], **place),
            self._event("response.content_part.done", part=part, **place),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _call(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if "id" in delta:
            events += self._close_message()
            self.calls[delta["index"]] = len(self.output)
            item = function_call_item(delta["id"], delta["function"]["name"], "")
            item["status"] = "in_progress"
            self.output.append(item)
            events.append(
                self._event(
                    "response.output_item.added", output_index=len(self.output) - 1, item=item
                )
            )
        fragment = delta.get("function", {}).get("arguments", "")
        if fragment:
            index = self.calls[delta["index"]]
            item = self.output[index]
            item["arguments"] += fragment
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=fragment,
                )
            )
        return events

    def _close_calls(self) -> list[str]:
        events: list[str] = []
        for index in self.calls.values():
            item = self.output[index]
            item["status"] = "completed"
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        """The events for one chat chunk (an error, a delta, or the closing usage)."""
        if "error" in chunk:
            return self._failed(chunk["error"])
        if not chunk["choices"]:
            return self._finished(chunk["usage"], chunk["speculative"])
        choice = chunk["choices"][0]
        delta = choice["delta"]
        events: list[str] = []
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        if choice["finish_reason"] is not None:
            self.finish_reason = choice["finish_reason"]
        return events

    def _finished(self, usage: dict[str, int], speculative: dict[str, Any]) -> list[str]:
        events = [] if self.output else self._open_message()  # an empty output: one text
        events += self._close_message() + self._close_calls()
        status, incomplete = _status(self.finish_reason)
        response = self._response(
            status,
            output=self.output,
            incomplete=incomplete,
            usage=usage,
            speculative=speculative,
        )
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=response)]

    def _failed(self, error: dict[str, Any]) -> list[str]:
        response = self._response("failed", output=self.output)
        response["error"] = {
            "code": error.get("code") or error["type"],
            "message": error["message"],
        }
        return [
            self._event(
                "error", code=error.get("code"), message=error["message"], param=error.get("param")
            ),
            self._event("response.failed", response=response),
        ]


async def response_stream(
    body: ResponseRequest, generation: AuditedGeneration, chat_events: AsyncIterator[str]
) -> AsyncIterator[str]:
    """``chat_events`` (the chat path's server-sent events, which commit the `completion`
    event before their end) as the Responses API's events."""
    events = ResponseEvents(body, generation.job, generation.backend.card.model_name)
    for event in events.started():
        yield event
    async for line in chat_events:
        data = line.removeprefix("data: ").strip()
        if data == "[DONE]":
            return
        for event in events.chunk(json.loads(data)):
            yield event
