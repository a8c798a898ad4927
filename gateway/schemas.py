"""Request and response bodies in OpenAI's shapes, plus Specgate's extensions.

Extensions: ``top_k``, ``speculative`` and vLLM's ``repetition_penalty``, ``min_tokens``,
structured-output parameters (``structured_outputs``, ``guided_json``, ``guided_regex``,
``guided_choice``) and its other request fields (``min_p``, ``ignore_eos``,
``stop_token_ids``, ``allowed_token_ids``, ``bad_words``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``request_id``, chat template options) on requests; ``speculative``
(acceptance figures) on responses. docs/agent-api.md tables every field.
Parameters OpenAI (or vLLM) defines but Specgate does not implement are accepted only at
their neutral value (so clients that send defaults keep working) and otherwise refused with
a 400 naming them; unknown parameters are refused as OpenAI refuses them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.api.types import MAX_SPECULATIVE_TOKENS, MAX_TOP_LOGPROBS, AcceptanceSource, Method
from engine.speculation.methods import RegisteredMethod

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_CHOICES = 16
MAX_STOP_SEQUENCES = 4

# Accepted values of parameters Specgate does not implement: each one's "off" setting.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    # vLLM's fields that Specgate does not implement.
    "priority": (None, 0),
    "prompt_logprobs": (None,),
    "return_token_ids": (None, False),
    "truncate_prompt_tokens": (None,),
    "documents": (None,),
}
_CHAT_UNSUPPORTED = (
    "functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort",
    "verbosity", "web_search_options", "service_tier", "store", "metadata", "prompt_cache_key",
    "safety_identifier", "documents",
)  # fmt: skip
_COMPLETION_UNSUPPORTED = ("best_of", "echo", "suffix")
_VLLM_UNSUPPORTED = ("priority", "prompt_logprobs", "return_token_ids", "truncate_prompt_tokens")
# Why a vLLM field is refused, for its 400.
_WHY_UNSUPPORTED = {
    "priority": "requests are admitted first come, first served",
    "prompt_logprobs": "the engine computes no log-probabilities of prompt tokens",
    "return_token_ids": "responses carry text only",
    "truncate_prompt_tokens": "a prompt too long is refused, never cut",
    "documents": "documents are not rendered into the chat template",
}
MAX_TOKEN_ID_LIST = 4096  # allowed_token_ids, stop_token_ids
MAX_BAD_WORDS = 64
# OpenAI's limits: a tool's name, logit_bias values, top_logprobs (engine.api.types).
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 300


def _check_neutral(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name or "parameter"
    if value not in _NEUTRAL[name]:
        why = f" ({_WHY_UNSUPPORTED[name]})" if name in _WHY_UNSUPPORTED else ""
        raise ValueError(f"'{name}' is not supported by Specgate{why}; leave it unset")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpeculativeRequest(_Strict):
    method: RegisteredMethod
    num_speculative_tokens: int | None = Field(default=None, ge=1, le=MAX_SPECULATIVE_TOKENS)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        default=False, description="vLLM extension: usage so far in every chunk."
    )


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [v for v in (self.json_, self.regex, self.choice, self.grammar) if v is not None]
        if len(given) + bool(self.json_object) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self


class _SamplingFields(_Strict):
    """Fields shared by both endpoints; ranges follow OpenAI's (vLLM's for its extensions)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="Specgate extension; 0 = off.")
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    speculative: StrictBool | SpeculativeRequest | None = Field(
        default=None,
        description="Specgate extension: true/absent default, false plain, or an object.",
    )
    store_content: StrictBool | None = Field(
        default=None,
        description="Specgate extension: keep this request's text, encrypted outside the audit "
        "chain (absent: the server's store_content setting).",
    )
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(
        default=None, gt=0.0, le=2.0, description="vLLM extension; 1 = off."
    )
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    min_tokens: int | None = Field(default=None, ge=0, description="vLLM extension.")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="vLLM extension.")
    ignore_eos: bool = Field(default=False, description="vLLM extension.")
    stop_token_ids: list[int] | None = Field(
        default=None, max_length=MAX_TOKEN_ID_LIST, description="vLLM extension."
    )
    allowed_token_ids: list[int] | None = Field(
        default=None, min_length=1, max_length=MAX_TOKEN_ID_LIST, description="vLLM extension."
    )
    bad_words: list[str] | None = Field(
        default=None, max_length=MAX_BAD_WORDS, description="vLLM extension."
    )
    include_stop_str_in_output: bool = Field(default=False, description="vLLM extension.")
    skip_special_tokens: bool = Field(default=True, description="vLLM extension.")
    request_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="vLLM extension: recorded in the request's audit event (client_request_id).",
    )
    priority: Any = None
    prompt_logprobs: Any = None
    return_token_ids: Any = None
    truncate_prompt_tokens: Any = None

    reject_vllm_unsupported = field_validator(*_VLLM_UNSUPPORTED, mode="before")(_check_neutral)
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="vLLM extension: constrain the output."
    )
    guided_json: dict[str, Any] | str | None = Field(default=None, description="vLLM (older).")
    guided_regex: str | None = Field(default=None, min_length=1, description="vLLM (older).")
    guided_choice: list[str] | None = Field(
        default=None, min_length=1, description="vLLM (older)."
    )

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit() or len(token) > 9:
                raise ValueError("logit_bias keys must be token ids (strings of digits)")
            if not -100.0 <= bias <= 100.0:
                raise ValueError("logit_bias values must lie in [-100, 100]")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, value: str | list[str] | None) -> str | list[str] | None:
        sequences = [value] if isinstance(value, str) else value or []
        if len(sequences) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(not sequence for sequence in sequences):
            raise ValueError("stop sequences must not be empty")
        return value

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class RefusalPart(_Strict):
    """An assistant's refusal as a content part (OpenAI's assistant messages may carry one);
    like the message's ``refusal`` it is not rendered into the prompt."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


def _returned(description: str) -> Any:
    """A field that OpenAI's response objects carry and the ``openai`` client dumps with a
    reply: accepted back in a request so a reply can be the next turn, never used, and left
    out of the request's stored content."""
    return Field(default=None, exclude=True, description=description)


class FunctionCall(_Strict):
    """A call's function. Extra fields stay refused (a misspelt one is a 400), except
    ``parsed_arguments``, which the client's ``stream()``/``parse()`` helpers add."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    arguments: str
    parsed_arguments: Any = _returned("Added by the openai client's helpers; ignored.")


class ToolCall(_Strict):
    """A tool call in an assistant message. Extra fields stay refused, except ``index``,
    which a call reassembled from a stream keeps."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = _returned("A streamed call's position; ignored.")


class ChatMessage(_Strict):
    """A message; an assistant turn may carry ``tool_calls`` and no content, a ``tool``
    message answers the call named by ``tool_call_id``.

    Every field of OpenAI's assistant message (request and response types alike) is
    declared, so a reply dumped by a client goes back as the next turn: ``annotations`` and
    the ``parse()`` helper's ``parsed`` are ignored, ``audio`` and the legacy
    ``function_call`` are accepted as null (Specgate produces neither). Any other field stays
    refused, so a misspelt one is a 400 naming it rather than silently dropped.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = _returned("Citations in a reply; ignored.")
    parsed: Any = _returned("The parse() helper's parsed content; ignored.")
    audio: None = _returned("Null only: Specgate produces no audio.")
    function_call: None = _returned("Null only: use tool_calls.")

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.role == "assistant":
            if self.content is None and not self.tool_calls:
                raise ValueError("an assistant message needs content or tool_calls")
        elif self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool messages, and only they, carry tool_call_id")
        if (
            self.role != "assistant"
            and isinstance(self.content, list)
            and any(isinstance(part, RefusalPart) for part in self.content)
        ):
            raise ValueError("only assistant messages carry refusal parts")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class FunctionDefinition(_Strict):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(pattern=TOOL_NAME_PATTERN)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJsonObject(_Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type"),
]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="vLLM extension: extra chat template variables."
    )
    add_generation_prompt: bool = Field(default=True, description="vLLM extension.")
    continue_final_message: bool = Field(default=False, description="vLLM extension.")
    documents: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None

    reject_unsupported = field_validator(*_CHAT_UNSUPPORTED, mode="before")(_check_neutral)

    @model_validator(mode="after")
    def _tools_and_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                raise ValueError("tool_choice names a function that is not in tools")
        elif self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)

    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = Field(
        default=None, description="vLLM extension on completions."
    )
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    reject_unsupported = field_validator(*_COMPLETION_UNSUPPORTED, mode="before")(_check_neutral)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeUsage(BaseModel):
    """Specgate extension: how speculation went for this response (all choices together);
    the fields are ``engine.api.types.SPECULATION_FIGURES``."""

    method: Method
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]
    num_target_passes: int
    acceptance_rate: float
    mean_acceptance_length: float
    fallback_active: bool
    acceptance_source: AcceptanceSource


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobInfo(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobInfo] | None
    refusal: None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: SpeculativeUsage


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists per output token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage
    speculative: SpeculativeUsage


class Artefact(BaseModel):
    """One versioned artefact (``engine.speculation.methods.Artefact``); ``version`` None where a
    remote server does not report it."""

    kind: str
    name: str | None
    version: str | None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specgate"
    aliases: list[str] = Field(
        default_factory=list, description="Other names a request's `model` may give it by."
    )
    target_version: str
    artefacts: list[Artefact] = Field(
        default_factory=list,
        description="Versioned artefacts served besides the target (a draft model, heads).",
    )
    speculative_methods: list[Method]
    max_context: int
    dtype: dict[str, Any] | None = Field(
        default=None,
        description="The dtype the target is served in: requested, chosen, why, and the "
        "measured CPU seconds per candidate where `auto` measured them.",
    )
    notes: list[str] = Field(
        default_factory=list,
        description="How this model is served, e.g. a demo draft not built yet.",
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


_KEY_STORE_CONTENT = (
    "Whether this key's requests keep their text, encrypted outside the chain and erasable "
    "(null: the server's store_content setting). A request's own store_content wins."
)


class KeyCreateRequest(_Strict):
    role: Literal["app", "auditor", "admin"]
    name: str = Field(min_length=1, max_length=128)
    store_content: StrictBool | None = Field(default=None, description=_KEY_STORE_CONTENT)


class KeyUpdateRequest(_Strict):
    store_content: StrictBool | None = Field(description=_KEY_STORE_CONTENT)


class KeyInfo(BaseModel):
    key_id: str
    name: str
    role: str
    store_content: bool | None = Field(description=_KEY_STORE_CONTENT)


class CreatedKey(KeyInfo):
    key: str = Field(description="The plaintext key; shown only in this response.")
