"""Request bodies of OpenAI's Responses API (``POST /v1/responses``), the part Specgate serves.

Stateless: nothing is stored, so ``store`` is accepted (true or false) and answered as
``false``, and ``previous_response_id`` is refused. Input items are messages,
``function_call`` items (an earlier reply's calls, sent back) and ``function_call_output``
items; tools are function tools. Fields an output item carries and the ``openai`` client sends
back with it (``id``, ``status``, ``annotations``) are accepted and ignored. Parameters for
features Specgate does not have are accepted only at their neutral value, as on
``/v1/chat/completions``; anything else is refused with a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, Tag, field_validator

from gateway.schemas import MAX_TOOLS, TOOL_NAME_PATTERN, FunctionDefinition, SpeculativeRequest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _returned(description: str) -> Any:
    """A field of an output item that comes back with it as input: accepted, never used."""
    return Field(default=None, exclude=True, description=description)


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = _returned("Citations in a reply; ignored.")
    logprobs: list[Any] | None = _returned("A reply's logprobs; ignored.")


TextContent = Annotated[InputText | OutputText, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]
    id: str | None = _returned("An output message's id; ignored.")
    status: str | None = _returned("An output message's status; ignored.")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Strict):
    """A call an earlier reply made, sent back ahead of its output."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    arguments: str
    id: str | None = _returned("The output item's id; ignored.")
    status: str | None = _returned("The output item's status; ignored.")


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str
    id: str | None = _returned("The item's id; ignored.")
    status: str | None = _returned("The item's status; ignored.")


def _item_type(value: Any) -> str:
    """An input item's type; a message may leave it out (OpenAI's "easy" input message)."""
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return str(getattr(value, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(FunctionDefinition):
    """A function tool as the Responses API writes it: the definition's fields beside
    ``type``, not under ``function``."""

    type: Literal["function"]


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME_PATTERN)


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJsonObject(_Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


TextFormat = Annotated[
    TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")
]


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponseRequest(_Strict):
    model: str
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = Field(
        default=None, description="Accepted; nothing is stored (the response says false)."
    )
    previous_response_id: str | None = Field(
        default=None, description="Refused: responses are not stored; send the whole input."
    )
    metadata: dict[str, str] | None = Field(default=None, description="Echoed, not recorded.")
    user: str | None = Field(default=None, max_length=256)
    truncation: Literal["disabled"] | None = None
    reasoning: None = None
    include: list[Any] | None = Field(default=None, max_length=0)
    service_tier: Literal["auto", "default"] | None = None
    speculative: StrictBool | SpeculativeRequest | None = Field(
        default=None,
        description="Specgate extension: true/absent default, false plain, or an object.",
    )
    store_content: StrictBool | None = Field(
        default=None,
        description="Specgate extension: keep this request's text, encrypted outside the audit "
        "chain (absent: the server's store_content setting).",
    )

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[FunctionTool] | None) -> list[FunctionTool] | None:
        names = [tool.name for tool in tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        return tools
