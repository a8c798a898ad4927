"""One audited generation: OpenAI request -> `request` event -> backend -> `completion` event.

Fail closed: the `request` event is committed before the backend sees the request (or, with
``start_before_request_commit``, before anything the backend generated is read: the response
starts only after the commit, and a failed commit cancels the generation), and a
non-streaming response leaves only after its `completion` event is committed; a stream ends
with ``[DONE]`` only after its `completion` event is committed.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import anyio
import structlog
from pydantic import BaseModel

from engine.api.chat import RESERVED_TEMPLATE_KWARGS, TemplateOptions
from engine.api.tool_parsers import (
    READERS,
    ArgumentsDelta,
    ArgumentsReader,
    BareReader,
    CallStarted,
    ParsedOutput,
    ToolCallReader,
    ToolEvent,
    read_all,
)
from engine.api.types import (
    CompiledConstraint,
    Constraint,
    EngineError,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    InvalidRequestError,
    SamplingParams,
    SpeculativeChoice,
    TokenLogprob,
)
from gateway.admission import Slots
from gateway.audit.log import AppendedEvent, AuditUnavailableError
from gateway.backends.base import BackendCard, Generation, GenerationBackend
from gateway.dependencies import Services
from gateway.errors import (
    APIError,
    audit_unavailable,
    completion_not_recorded,
    error_body,
    from_engine_error,
    shutting_down,
)
from gateway.keys import Principal
from gateway.lifecycle import ShutdownError
from gateway.observability.telemetry import CompletionTelemetry
from gateway.privacy.commitments import CommitmentKey, DataKey, text_bytes, token_id_bytes
from gateway.privacy.store import SealedContent, key_owner_subject, user_subject
from gateway.quota_gate import Ticket
from gateway.recording import (
    append_durably,
    combined_stats,
    completion_payload,
    request_payload,
    schedule_record,
)
from gateway.schemas import (
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    FunctionCall,
    NamedToolChoice,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    ResponseMessage,
    SpeculativeRequest,
    SpeculativeUsage,
    TokenLogprobInfo,
    ToolCall,
    TopLogprob,
)
from gateway.served_models import ServedModel

log = structlog.get_logger(__name__)

Answer = TypeVar("Answer")

Kind = Literal["chat", "completion"]
ROUTES: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
# gen_ai.operation.name per the OpenTelemetry GenAI semantic conventions.
GENAI_OPERATIONS: dict[Kind, str] = {"chat": "chat", "completion": "text_completion"}


# Seeds drawn for requests that give none: well inside the 63 bits the engine accepts, so that
# ``seed + index`` for every choice still fits.
DRAWN_SEED_BITS = 62


@dataclass(frozen=True)
class Prompt:
    """``committed``: the bytes the `request` event's keyed commitment covers (the rendered
    chat template, the prompt string, or the token ids as decimal text)."""

    token_ids: tuple[int, ...]
    committed: bytes
    content: Any
    param: str
    template: dict[str, Any] | None = None  # a chat prompt's template options, as recorded


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's output becomes tool calls. ``auto``: the template's parser reads
    calls out of free text; ``named``: the output is constrained to the function's arguments
    (its JSON schema); ``required``: to a JSON list of ``{"name", "parameters"}`` calls."""

    mode: Literal["auto", "required", "named"]
    parser: str
    named: str | None = None
    parallel: bool = True

    def reader(self) -> ToolCallReader:
        """A fresh reader of one choice's output (streamed, or whole in ``parse``)."""
        if self.mode == "named":
            assert self.named is not None
            return ArgumentsReader(self.named)
        max_calls = None if self.parallel else 1
        if self.mode == "required":
            return BareReader(("parameters",), max_calls=max_calls)
        return READERS[self.parser](max_calls)

    def parse(self, text: str) -> ParsedOutput:
        return read_all(self.reader(), text)


@dataclass
class Job:
    """A validated request, ready for the backend."""

    kind: Kind
    request_id: str
    prompt: Prompt
    sampling: list[SamplingParams]
    speculative: SpeculativeChoice
    stream: bool
    include_usage: bool
    user: str | None
    store_content: bool = False
    client_request_id: str | None = None  # vLLM's request_id: recorded, never the id
    continuous_usage: bool = False  # usage so far in every streamed chunk (vLLM's)
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolPlan | None = None
    compiled: CompiledConstraint | None = None  # the sampling's constraint, compiled

    @property
    def route(self) -> str:
        return ROUTES[self.kind]

    @property
    def response_id(self) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.request_id}"


def speculative_choice(
    requested: bool | SpeculativeRequest | None, card: BackendCard
) -> SpeculativeChoice:
    if requested is None or requested is True:
        return SpeculativeChoice()
    if requested is False:
        return SpeculativeChoice(method="none")
    if requested.method not in card.available_methods:
        loaded = ", ".join(card.available_methods)
        raise APIError(
            400,
            f"Speculation method '{requested.method}' is not loaded on this server; "
            f"loaded: {loaded}.",
            param="speculative.method",
            code="method_unavailable",
        )
    return SpeculativeChoice(requested.method, requested.num_speculative_tokens)


def _check_prompt_bytes(size: int, limit: int, param: str) -> None:
    if size > limit:
        raise APIError(
            400,
            f"The {param} is {size} bytes of text; this server accepts at most {limit} "
            "(max_prompt_bytes) before tokenizing.",
            param=param,
            code="prompt_too_large",
        )


def chat_prompt(
    body: ChatCompletionRequest, backend: GenerationBackend, max_prompt_bytes: int
) -> Prompt:
    """Render the messages with the model's chat template, as the request's template options
    ask (by default with the generation prompt added); the tools too unless ``tool_choice``
    is ``none``."""
    messages: list[dict[str, Any]] = []
    for message in body.messages:
        rendered: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": message.text(),
        }
        if message.tool_calls:
            rendered["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            rendered["tool_call_id"] = message.tool_call_id
        messages.append(rendered)
    tools = (
        [tool.model_dump(exclude_none=True) for tool in body.tools]
        if body.tools and body.tool_choice != "none"
        else None
    )
    size = len(json.dumps(messages).encode("utf-8")) + len(json.dumps(tools).encode("utf-8"))
    _check_prompt_bytes(size, max_prompt_bytes, "messages")
    options = template_options(body)
    text, token_ids = backend.render_chat(messages, tools, options)
    return Prompt(
        token_ids,
        text_bytes(text),
        [m.model_dump(exclude_none=True) for m in body.messages],
        "messages",
        {
            "add_generation_prompt": options.add_generation_prompt,
            "continue_final_message": options.continue_final_message,
            "chat_template_kwargs": dict(options.kwargs),
        },
    )


def template_options(body: ChatCompletionRequest) -> TemplateOptions:
    """vLLM's template options, checked as vLLM checks them."""
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise APIError(
                400,
                "continue_final_message needs add_generation_prompt: false (the final message "
                "is continued, not answered).",
                param="continue_final_message",
            )
        if body.messages[-1].role != "assistant":
            raise APIError(
                400,
                "continue_final_message needs an assistant message last.",
                param="continue_final_message",
            )
    kwargs = body.chat_template_kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise APIError(
            400,
            f"chat_template_kwargs may not set {', '.join(reserved)}; use the request's own "
            "fields.",
            param="chat_template_kwargs",
        )
    return TemplateOptions(body.add_generation_prompt, body.continue_final_message, kwargs)


def _arguments(text: str) -> Any:
    """A call's arguments as templates expect them: the JSON value (its text if not JSON)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def tool_plan(body: ChatCompletionRequest, card: BackendCard) -> ToolPlan | None:
    if not body.tools or body.tool_choice == "none":
        return None
    parallel = body.parallel_tool_calls is not False
    if isinstance(body.tool_choice, NamedToolChoice):
        return ToolPlan("named", card.tool_call_parser, body.tool_choice.function.name, parallel)
    if body.tool_choice == "required":
        return ToolPlan("required", card.tool_call_parser, None, parallel)
    return ToolPlan("auto", card.tool_call_parser, None, parallel)


def _parameters(body: ChatCompletionRequest, name: str) -> dict[str, Any]:
    for tool in body.tools or []:
        if tool.function.name == name:
            return tool.function.parameters or {"type": "object"}
    raise AssertionError("the schema checks that a named tool exists")


def constraint(
    body: ChatCompletionRequest | CompletionRequest, tools: ToolPlan | None
) -> tuple[str, Constraint] | None:
    """The one output constraint a request asks for and the parameter that asks for it (400
    when it asks for two). A ``tool_choice`` that forces a call makes this turn's output a
    tool call; ``response_format`` shapes text answers, which this turn cannot give, so it is
    set aside here (as OpenAI does: an agent with tools and a typed answer sends both)."""
    found: list[tuple[str, Constraint]] = []
    forced = isinstance(body, ChatCompletionRequest) and tools is not None and (
        tools.mode == "required" or (tools.mode == "named" and tools.named is not None)
    )
    fmt = None if forced else body.response_format
    if isinstance(fmt, ResponseFormatJsonObject):
        found.append(("response_format", Constraint("json_object", "{}")))
    elif isinstance(fmt, ResponseFormatJsonSchema):
        schema = fmt.json_schema.schema_ or {"type": "object"}
        found.append(("response_format", Constraint("json_schema", _schema_json(schema))))
    if isinstance(body, ChatCompletionRequest):
        if tools is not None and tools.mode == "named" and tools.named is not None:
            schema = _parameters(body, tools.named)
            found.append(("tool_choice", Constraint("json_schema", _schema_json(schema))))
        elif tools is not None and tools.mode == "required":
            found.append(("tool_choice", Constraint("json_schema", _schema_json(_calls(body)))))
    outputs = body.structured_outputs
    if outputs is not None:
        if outputs.json_ is not None:
            found.append(("structured_outputs", _json_constraint(outputs.json_)))
        elif outputs.regex is not None:
            found.append(("structured_outputs", Constraint("regex", outputs.regex)))
        elif outputs.choice is not None:
            found.append(("structured_outputs", Constraint("choice", json.dumps(outputs.choice))))
        elif outputs.grammar is not None:
            found.append(("structured_outputs", Constraint("grammar", outputs.grammar)))
        else:
            found.append(("structured_outputs", Constraint("json_object", "{}")))
    if body.guided_json is not None:
        found.append(("guided_json", _json_constraint(body.guided_json)))
    if body.guided_regex is not None:
        found.append(("guided_regex", Constraint("regex", body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", Constraint("choice", json.dumps(body.guided_choice))))
    if len(found) > 1:
        raise APIError(
            400,
            f"Only one output constraint may be given; this request has {len(found)} "
            f"({', '.join(name for name, _ in found)}).",
            param=found[1][0],
        )
    return found[0] if found else None


def compiled_constraint(
    asked: tuple[str, Constraint] | None, backend: GenerationBackend
) -> CompiledConstraint | None:
    """The constraint compiled by the backend now, before anything is audited: one that does
    not compile is a 400 naming the parameter that asked for it, with no record left."""
    if asked is None:
        return None
    param, wanted = asked
    try:
        return backend.compile_constraint(wanted)
    except InvalidRequestError as error:
        raise APIError(400, str(error), param=param) from error


def _json_constraint(schema: dict[str, Any] | str) -> Constraint:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise APIError(
                400, f"The JSON schema is not JSON: {error}", param="guided_json"
            ) from error
    if not isinstance(schema, dict):
        raise APIError(400, "A JSON schema must be a JSON object.", param="guided_json")
    return Constraint("json_schema", _schema_json(schema))


def _calls(body: ChatCompletionRequest) -> dict[str, Any]:
    """The schema of ``tool_choice: required`` output: a list of one or more calls."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "parameters": tool.function.parameters or {"type": "object"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in body.tools or []
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": options}, "minItems": 1}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def _schema_json(schema: Any) -> str:
    """A JSON schema as compact JSON with its keys in the order given: the order of
    ``properties`` is the order the output's keys are generated in, so it is part of the
    constraint (and of its grammar, its audit hash and a replay of it)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _logit_bias(
    body: ChatCompletionRequest | CompletionRequest, card: BackendCard
) -> tuple[tuple[int, float], ...]:
    bias = tuple((int(token), value) for token, value in (body.logit_bias or {}).items())
    if any(token >= card.vocab_size for token, _ in bias):
        raise APIError(
            400, f"logit_bias token ids must lie in [0, {card.vocab_size}).", param="logit_bias"
        )
    return bias


def _token_ids(ids: list[int] | None, card: BackendCard, param: str) -> tuple[int, ...]:
    if any(token < 0 or token >= card.vocab_size for token in ids or ()):
        raise APIError(400, f"{param} must lie in [0, {card.vocab_size}).", param=param)
    return tuple(ids or ())


def _bad_words(
    body: ChatCompletionRequest | CompletionRequest, backend: GenerationBackend
) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids as vLLM finds them: the word as given (leading spaces
    stripped), and with one leading space where that tokenizes to as many tokens with a
    different first token (the word inside a sentence)."""
    sequences: list[tuple[int, ...]] = []
    for word in body.bad_words or ():
        bare = backend.tokenize(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise APIError(400, "bad_words must not be empty.", param="bad_words")
        sequences.append(bare)
        spaced = backend.tokenize(" " + word.lstrip(), add_special_tokens=False)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    return tuple(sequences)


def _logprobs(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def completion_prompt(
    body: CompletionRequest, backend: GenerationBackend, max_prompt_bytes: int
) -> Prompt:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(
                400,
                "Batched prompts are not supported; send one prompt per request.",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "The prompt must not be empty.", param="prompt")
        _check_prompt_bytes(len(prompt.encode("utf-8")), max_prompt_bytes, "prompt")
        token_ids = backend.tokenize(prompt)
        return Prompt(token_ids, text_bytes(prompt), prompt, "prompt")
    token_ids = tuple(int(token) for token in prompt)  # type: ignore[arg-type]
    if not token_ids:
        raise APIError(400, "The prompt must not be empty.", param="prompt")
    vocab = backend.card.vocab_size
    if any(token < 0 or token >= vocab for token in token_ids):
        raise APIError(400, f"Token ids in the prompt must lie in [0, {vocab}).", param="prompt")
    return Prompt(token_ids, token_id_bytes(token_ids), list(token_ids), "prompt")


def _max_tokens(
    body: ChatCompletionRequest | CompletionRequest, prompt: Prompt, card: BackendCard
) -> int:
    requested = body.max_tokens
    param = "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        if requested is not None and requested != body.max_completion_tokens:
            raise APIError(
                400, "max_tokens and max_completion_tokens disagree; send one.", param="max_tokens"
            )
        requested, param = body.max_completion_tokens, "max_completion_tokens"
    room = card.max_context - len(prompt.token_ids)
    if requested is None and room > 0:
        return room
    asked = requested if requested is not None else 1
    if asked > room:
        raise APIError(
            400,
            f"This model's maximum context length is {card.max_context} tokens. However, you "
            f"requested {len(prompt.token_ids) + asked} tokens ({len(prompt.token_ids)} in the "
            f"{prompt.param}, {asked} in the completion). Please reduce the length of the "
            f"{prompt.param} or completion.",
            param=param if room > 0 else prompt.param,
            code="context_length_exceeded",
        )
    return asked


def build_job(
    body: ChatCompletionRequest | CompletionRequest,
    backend: GenerationBackend,
    max_prompt_bytes: int,
    store_content: bool = False,
) -> Job:
    """Check the request against the model it was routed to (``backend``); raises APIError
    naming the parameter. Templating and tokenizing are CPU work: call it off the event loop.
    A request without a seed gets one drawn here, so that its `request` event records it
    (replay)."""
    card = backend.card
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400, "stream_options is only allowed when stream is true.", param="stream_options"
        )
    kind: Kind = "chat" if isinstance(body, ChatCompletionRequest) else "completion"
    prompt = (
        chat_prompt(body, backend, max_prompt_bytes)
        if isinstance(body, ChatCompletionRequest)
        else completion_prompt(body, backend, max_prompt_bytes)
    )
    max_tokens = _max_tokens(body, prompt, card)
    seed = body.seed if body.seed is not None else secrets.randbits(DRAWN_SEED_BITS)
    tools = tool_plan(body, card) if isinstance(body, ChatCompletionRequest) else None
    if body.min_tokens is not None and body.min_tokens > max_tokens:
        raise APIError(400, "min_tokens must not exceed max_tokens.", param="min_tokens")
    compiled = compiled_constraint(constraint(body, tools), backend)
    bad_words = _bad_words(body, backend)
    sampling = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p or 0.0,
            seed=seed + index,
            stop=body.stop_sequences(),
            stop_token_ids=_token_ids(body.stop_token_ids, card, "stop_token_ids"),
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            seed_drawn=body.seed is None,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            logit_bias=_logit_bias(body, card),
            min_tokens=body.min_tokens or 0,
            allowed_token_ids=_token_ids(body.allowed_token_ids, card, "allowed_token_ids"),
            bad_words=bad_words,
            constraint=None if compiled is None else compiled.constraint,
            logprobs=_logprobs(body),
        )
        for index in range(body.n)
    ]
    return Job(
        kind=kind,
        request_id=uuid.uuid4().hex,
        prompt=prompt,
        sampling=sampling,
        speculative=speculative_choice(body.speculative, card),
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        continuous_usage=bool(
            body.stream_options
            and body.stream_options.include_usage
            and body.stream_options.continuous_usage_stats
        ),
        user=body.user,
        client_request_id=body.request_id,
        store_content=store_content if body.store_content is None else body.store_content,
        tools=tools,
        compiled=compiled,
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


@dataclass
class _ChoiceState:
    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class AuditedGeneration:
    """Runs one Job against the backend of the model it names, with its `request` and
    `completion` events."""

    services: Services
    principal: Principal
    model: ServedModel
    job: Job
    slots: Slots | None = None
    quota: Ticket | None = None  # charged the tokens served when the request closes
    started: float = field(default_factory=time.perf_counter)
    request_event: AppendedEvent | None = None
    choices: list[_ChoiceState] = field(default_factory=list)
    telemetry: CompletionTelemetry | None = None
    handles: list[Generation] = field(default_factory=list)
    closed: bool = False
    # The key the commitments are made under; a data key where content is stored.
    commitments: CommitmentKey | None = None
    data_key: DataKey | None = None

    @property
    def audit_id(self) -> str:
        assert self.request_event is not None
        return self.request_event.event_id

    @property
    def backend(self) -> GenerationBackend:
        return self.model.backend

    async def open(self) -> list[Generation]:
        """Commit the `request` event, then submit; returns the backend's generations.

        Runs under the completion's GenAI span, so that the audit write and the backend's spans
        are its children; `close` ends the span, or this method when nothing was audited."""
        job = self.job
        prompt = job.prompt.content
        self.telemetry = self.services.telemetry.start_completion(
            operation=GENAI_OPERATIONS[job.kind],
            model=self.backend.card.model_name,
            sampling=job.sampling[0],
            input_messages=prompt if job.kind == "chat" else [{"role": "user", "content": prompt}],
        )
        with self.telemetry.activate():
            try:
                return await self._submit()
            except BaseException:
                if self.request_event is None:
                    self.telemetry.record_error("audit_unavailable")
                    self.telemetry.end()
                raise

    async def _commitment_key(self, subject_ref: str) -> CommitmentKey:
        """The subject's data key where content is stored (fetched or created), else the
        deployment commitment key; AuditUnavailableError when the store does not answer."""
        privacy = self.services.privacy
        if not self.job.store_content:
            self.commitments = privacy.deployment_commitments
        else:
            self.data_key = await self.services.offload.db(privacy.data_key, subject_ref)
            self.commitments = self.data_key.commitments
        return self.commitments

    async def _submit(self) -> list[Generation]:
        """Commit the `request` event and hand the job to the backend: after the commit, or
        (``start_before_request_commit``) while it is in flight. Either way the generations
        are returned, and so read, only once the event is committed; when it is not, they
        are cancelled before anything of them was read."""
        job = self.job
        services = self.services
        early = services.settings.start_before_request_commit
        submit_error: EngineError | None = None
        self.choices = [_ChoiceState() for _ in job.sampling]
        subject = user_subject(job.user) if job.user else key_owner_subject(self.principal.key_id)
        subject_ref = services.privacy.subject_ref(subject)
        attempt: Future[AppendedEvent] | None = None
        try:
            commitments = await self._commitment_key(subject_ref)
            payload = request_payload(
                card=self.backend.card,
                backend=self.model.kind,
                principal=self.principal,
                route=job.route,
                request_id=job.request_id,
                prompt_commitment=commitments.commit(job.prompt.committed),
                commitment_key=commitments.description,
                prompt_tokens=len(job.prompt.token_ids),
                sampling=job.sampling[0],
                n=len(job.sampling),
                speculative=job.speculative,
                stream=job.stream,
                subject_ref=subject_ref,
                store_content=job.store_content,
                client_request_id=job.client_request_id,
                chat_template=job.prompt.template,
            )
            payload["instance_id"] = services.instance_id
            if self.principal.team is not None:
                payload["team"] = self.principal.team
            if self.data_key is None:
                attempt = services.appender.submit("request", self.principal.key_id, payload)
            else:
                content = {
                    "kind": job.kind,
                    "prompt": job.prompt.content,
                    "prompt_token_ids": list(job.prompt.token_ids),
                }
                attempt = services.offload.submit_db(
                    services.privacy.append_with_content,
                    "request",
                    self.principal.key_id,
                    payload,
                    self.data_key,
                    "prompt",
                    content,
                )
            if early:
                submit_error = self._start_backend()
            self.request_event = await services.offload.wait_db(attempt, "request append")
        except AuditUnavailableError as error:
            self._cancel_handles()
            log.error("request_not_audited", error=str(error))
            if attempt is not None:
                # Settled on a pool thread or on the loop: the spool's fsync goes to its own.
                io = services.offload.submit_io
                attempt.add_done_callback(lambda late: io(self._answer_late_request, late))
            raise audit_unavailable() from error
        except BaseException:
            self._cancel_handles()
            raise
        if not early:
            submit_error = self._start_backend()
        if submit_error is not None:
            self._cancel_handles()
            await self.close_quietly("error", str(submit_error))
            raise from_engine_error(submit_error) from submit_error
        services.lifecycle.track(self.handles)
        return self.handles

    def _start_backend(self) -> EngineError | None:
        """Submit every choice to the backend; the error that refused one (the ones already
        submitted stay in ``handles``, for the caller to cancel), or None."""
        job = self.job
        try:
            for index, sampling in enumerate(job.sampling):
                request = GenerationRequest(
                    prompt_ids=job.prompt.token_ids,
                    sampling=sampling,
                    speculative=job.speculative,
                    request_id=f"{job.request_id}-{index}",
                    compiled=job.compiled,
                )
                self.handles.append(self.backend.submit(request))
        except EngineError as error:
            return error
        return None

    def _cancel_handles(self) -> None:
        for handle in self.handles:
            handle.cancel()

    def _answer_late_request(self, attempt: Future[AppendedEvent]) -> None:
        """A `request` event that commits after the client was told 503 gets a `completion`
        saying it was not served (on the spool's thread; the spool never waits)."""
        if attempt.cancelled() or attempt.exception() is not None:
            return
        payload = self._completion_payload("not_served", "the request event committed late")
        payload["request_event_id"] = attempt.result().event_id
        try:
            self.services.spool.enqueue("completion", self.principal.key_id, payload)
        except OSError:
            log.exception("late_request_not_answered")

    async def run(self, render: Callable[[list[GenerationResult]], Answer]) -> Answer:
        """Non-streaming: wait for every choice, then commit the `completion` event and
        return ``render(results)``, which is built while the commit is in flight (it is
        returned, and so sent, only once the event is committed or spooled)."""
        handles = await self.open()
        try:
            results = list(await asyncio.gather(*(handle.result_async() for handle in handles)))
        except EngineError as error:
            await self.close_quietly("error", str(error))
            raise from_engine_error(error) from error
        except ShutdownError as error:
            await self.close_quietly("shutdown", str(error))
            raise shutting_down(str(error)) from error
        except BaseException:
            for handle in handles:
                handle.cancel()
            with anyio.CancelScope(shield=True):
                await self.close_quietly("cancelled", "the client disconnected")
            raise
        for state, result in zip(self.choices, results, strict=True):
            state.text, state.num_tokens = result.text, len(result.token_ids)
            state.token_ids = list(result.token_ids)
            state.logprobs = list(result.logprobs or ())
            state.finish_reason, state.stats = result.finish_reason, result.stats
        answers: list[Answer] = []
        try:
            await self.close("ok", None, lambda: answers.append(render(results)))
        except AuditUnavailableError as error:
            log.error("completion_not_audited", error=str(error))
            raise completion_not_recorded() from error
        return answers[0]

    async def stream(self, handles: list[Generation]) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chunk format, then usage (when asked), then
        ``[DONE]`` once the `completion` event is committed. Choices stream one after another."""
        usage_so_far = self.usage if self.job.continuous_usage else None
        chunks = StreamChunks(self.job, self.backend.card, usage_so_far)
        try:
            for index, handle in enumerate(handles):
                state = self.choices[index]
                reader = None if self.job.tools is None else self.job.tools.reader()
                if self.job.kind == "chat":
                    yield _sse(
                        chunks.choice(index, {"delta": {"role": "assistant", "content": ""}}, None)
                    )
                async for delta in handle.deltas():
                    offset = len(state.text)
                    state.text += delta.text
                    state.num_tokens += len(delta.token_ids)
                    state.token_ids.extend(delta.token_ids)
                    if delta.finish_reason is not None:
                        state.finish_reason, state.stats = delta.finish_reason, delta.stats
                    if reader is not None:
                        for chunk in chunks.tool_deltas(
                            index, reader, delta.text, delta.finish_reason
                        ):
                            yield _sse(chunk)
                        continue
                    if delta.text or delta.finish_reason is not None or delta.logprobs:
                        yield _sse(
                            chunks.text(
                                index, delta.text, delta.finish_reason, delta.logprobs, offset
                            )
                        )
        except EngineError as error:
            await self.close_quietly("error", str(error))
            yield _sse(_error_chunk(from_engine_error(error)))
            return
        except ShutdownError as error:
            await self.close_quietly("shutdown", str(error))
            yield _sse(_error_chunk(shutting_down(str(error))))
            return
        except Exception as error:  # a fault in the backend: a server error, not a disconnect
            log.exception("stream_failed")
            await self.close_quietly("error", str(error))
            yield _sse(_error_chunk(from_engine_error(error)))
            return
        except BaseException:
            for handle in handles:
                handle.cancel()
            # The client went away: the task is being cancelled, so shield the audit write.
            with anyio.CancelScope(shield=True):
                await self.close_quietly("cancelled", "the client disconnected")
            raise
        try:
            await self.close("ok", None)
        except AuditUnavailableError as error:
            log.error("completion_not_audited", error=str(error))
            yield _sse(_error_chunk(completion_not_recorded()))
            return
        if self.job.include_usage:
            yield _sse(chunks.usage(self.usage(), self.speculative()))
        yield "data: [DONE]\n\n"

    def usage(self) -> dict[str, int]:
        return usage(
            len(self.job.prompt.token_ids), sum(state.num_tokens for state in self.choices)
        )

    def stats(self) -> GenerationStats | None:
        return combined_stats([state.stats for state in self.choices if state.stats is not None])

    def speculative(self) -> SpeculativeUsage:
        """Figures over all choices; only once every choice has finished."""
        stats = self.stats()
        assert stats is not None and len(self.choices) > 0
        return speculative_usage(stats)

    def _completion_payload(self, outcome: str, error: str | None) -> dict[str, Any]:
        commitments = self.commitments
        assert commitments is not None
        return completion_payload(
            request_event_id=self.audit_id if self.request_event else "",
            outcome=outcome,
            error=error,
            commitments=[commitments.commit(text_bytes(state.text)) for state in self.choices],
            commitment_key=commitments.description,
            schedules=[schedule_record(state.stats) for state in self.choices],
            finish_reasons=[state.finish_reason for state in self.choices],
            prompt_tokens=len(self.job.prompt.token_ids),
            completion_tokens=sum(state.num_tokens for state in self.choices),
            stats=self.stats(),
            latency_s=time.perf_counter() - self.started,
        )

    def _sealed_completion(self) -> SealedContent | None:
        """The choices' text and tokens, encrypted under the subject's data key, where the
        request's content is stored: committed with the `completion` event, directly or from
        the durable spool (which never holds the text)."""
        if self.data_key is None:
            return None
        content = {"choices": [{"text": s.text, "token_ids": s.token_ids} for s in self.choices]}
        return SealedContent.seal(self.data_key, "completion", content)

    def finish(self) -> None:
        """Give back the request's admission slots and stop tracking its backend work."""
        self.services.lifecycle.forget(self.handles)
        if self.slots is not None:
            self.slots.release()
            self.slots = None

    async def close(
        self, outcome: str, error: str | None, meanwhile: Callable[[], None] | None = None
    ) -> None:
        """Commit the `completion` event for whatever the choices hold now: directly, or
        through the durable spool when the store does not answer in time. Raises
        AuditUnavailableError only when neither could take it. The telemetry of the result,
        and ``meanwhile``, run on the loop while the commit is in flight."""
        self.finish()
        self.closed = True
        payload = self._completion_payload(outcome, error)
        telemetry = self.telemetry
        assert telemetry is not None

        def alongside() -> None:
            self._record_outcome(telemetry, outcome)
            if meanwhile is not None:
                meanwhile()

        services = self.services
        charging = None
        if self.quota is not None:
            charging = services.quotas.charge(self.quota, self.usage()["total_tokens"])
        try:
            with telemetry.activate():
                await append_durably(
                    services.offload,
                    services.spool,
                    services.appender,
                    "completion",
                    self.principal.key_id,
                    payload,
                    self._sealed_completion(),
                    meanwhile=alongside,
                )
        finally:
            telemetry.end()
            if charging is not None:
                await services.quotas.settle(charging)

    def _record_outcome(self, telemetry: CompletionTelemetry, outcome: str) -> None:
        stats = self.stats()
        if stats is not None:
            telemetry.record_result(
                response_id=self.job.response_id,
                response_model=self.backend.card.model_name,
                finish_reasons=[s.finish_reason for s in self.choices if s.finish_reason],
                stats=stats,
                output_texts=[state.text for state in self.choices],
            )
        if outcome != "ok":
            telemetry.record_error(outcome)

    async def close_quietly(self, outcome: str, error: str) -> None:
        """Record a failed or abandoned request; the client hears of the original failure."""
        try:
            await self.close(outcome, error)
        except AuditUnavailableError as audit_error:
            log.error("completion_not_audited", outcome=outcome, error=str(audit_error))


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


def _error_chunk(error: APIError) -> dict[str, Any]:
    return error_body(error.message, error.type, error.param, error.code)


def _sse(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
