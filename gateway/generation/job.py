"""A chat or completions request turned into what the backend runs: the prompt, sampling, the
output constraint and the tool plan (``build_job``), refused with 400 where it cannot run."""

from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from engine.api.chat import RESERVED_TEMPLATE_KWARGS, TemplateOptions
from engine.api.tool_parsers import (
    READERS,
    ArgumentsReader,
    BareReader,
    ParsedOutput,
    ToolCallReader,
    read_all,
)
from engine.api.types import (
    CompiledConstraint,
    Constraint,
    InvalidRequestError,
    SamplingParams,
    SpeculativeChoice,
)
from gateway.backends.base import BackendCard, GenerationBackend
from gateway.errors import (
    APIError,
)
from gateway.privacy.commitments import text_bytes, token_id_bytes
from gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    SpeculativeRequest,
)

log = structlog.get_logger(__name__)

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
