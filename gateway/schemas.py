"""Request and response bodies in OpenAI's shapes, plus Specgate's extensions.

Extensions: ``top_k`` and ``speculative`` on requests; ``speculative`` (acceptance figures) on
responses. Parameters OpenAI defines but Specgate does not implement are accepted only at
their neutral value (so clients that send defaults keep working) and otherwise refused with
a 400 naming them; unknown parameters are refused as OpenAI refuses them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, field_validator

from engine.types import Method

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_CHOICES = 16
MAX_STOP_SEQUENCES = 4

# Accepted values of parameters Specgate does not implement: each one's "off" setting.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
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
}
_CHAT_UNSUPPORTED = (
    "logprobs", "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "tools",
    "tool_choice", "parallel_tool_calls", "functions", "function_call", "response_format",
    "audio", "modalities", "prediction", "reasoning_effort", "verbosity", "web_search_options",
    "service_tier", "store", "metadata", "prompt_cache_key", "safety_identifier",
)  # fmt: skip
_COMPLETION_UNSUPPORTED = (
    "logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "best_of", "echo",
    "suffix",
)  # fmt: skip


def _check_neutral(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name or "parameter"
    if value not in _NEUTRAL[name]:
        raise ValueError(f"'{name}' is not supported by Specgate; leave it unset")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpeculativeRequest(_Strict):
    method: Method
    num_speculative_tokens: int | None = Field(default=None, ge=1, le=16)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by both endpoints; ranges follow OpenAI's."""

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


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
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


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)

    logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    reject_unsupported = field_validator(*_COMPLETION_UNSUPPORTED, mode="before")(_check_neutral)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeUsage(BaseModel):
    """Specgate extension: how speculation went for this response (all choices together)."""

    method: Method
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float
    mean_acceptance_length: float
    fallback_active: bool


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: SpeculativeUsage


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage
    speculative: SpeculativeUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specgate"
    target_version: str
    draft: str | None
    draft_version: str | None
    speculative_methods: list[Method]
    max_context: int
    notes: list[str] = Field(
        default_factory=list,
        description="How this model is served, e.g. a demo draft not built yet.",
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class KeyCreateRequest(_Strict):
    role: Literal["app", "auditor", "admin"]
    name: str = Field(min_length=1, max_length=128)


class KeyInfo(BaseModel):
    key_id: str
    name: str
    role: str


class CreatedKey(KeyInfo):
    key: str = Field(description="The plaintext key; shown only in this response.")
