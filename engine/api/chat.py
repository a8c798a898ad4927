"""Chat messages to prompt text with the model's own chat template.

A checkpoint without a template (many base models) cannot serve chat: that is the
client's request meeting this model, so it is an ``InvalidRequestError`` naming the
problem, as is a template that refuses the messages (one that insists on alternating roles,
say), never a server error.

Tools: a template that knows them (it mentions ``tools``) gets them through
``apply_chat_template(tools=...)``, and assistant ``tool_calls`` and ``tool`` messages as
they come. A template that does not (the demo's ChatML) gets the Hermes convention spelled
out in its messages: the tools and the ``<tool_call>`` format in the system message, earlier
calls as ``<tool_call>`` JSON in the assistant's text, results as ``<tool_response>`` in a
user turn, so that the output parser (``engine.api.tool_parsers``) reads what the model was
shown.

``TemplateOptions`` carries vLLM's rendering options: ``add_generation_prompt``,
``continue_final_message`` (the last assistant message is left open for the model to go on
with) and ``chat_template_kwargs`` (extra template variables, e.g. ``enable_thinking``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from engine.api.types import InvalidRequestError, NoChatTemplateError

HERMES_TOOL_PROMPT = (
    "You may call one or more functions to assist with the user query. The function "
    "signatures are within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each "
    "function call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)

# ``apply_chat_template``'s own parameters and the variables it sets: template kwargs may not
# replace them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages", "conversation", "tools", "documents", "chat_template", "tokenize",
        "add_generation_prompt", "continue_final_message", "return_dict", "tokenizer_kwargs",
        "return_assistant_tokens_mask", "padding", "truncation", "max_length",
        "return_tensors", "bos_token", "eos_token", "raise_exception",
    }
)  # fmt: skip


@dataclass(frozen=True)
class TemplateOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict)


DEFAULT_TEMPLATE = TemplateOptions()


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    options: TemplateOptions = DEFAULT_TEMPLATE,
) -> str:
    """The prompt text for ``messages`` (and ``tools``), rendered as ``options`` ask (by
    default with the generation prompt added)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise NoChatTemplateError(
            "This model has no chat template (none in its tokenizer files), so it cannot "
            "serve chat completions; send a plain prompt to /v1/completions instead.",
            "messages",
        )
    knows_tools = isinstance(template, str) and "tools" in template
    rendered = [dict(m) for m in messages] if knows_tools else hermes_messages(messages, tools)
    try:
        text = tokenizer.apply_chat_template(
            rendered,
            tools=[dict(tool) for tool in tools] if tools and knows_tools else None,
            tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **options.kwargs,
        )
    except (TemplateError, ValueError) as error:
        raise InvalidRequestError(
            f"The model's chat template refused these messages: {error}", "messages"
        ) from error
    assert isinstance(text, str)
    return text


def hermes_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, str]]:
    """Plain role/content messages carrying the tools, calls and results as Hermes text."""
    out: list[dict[str, str]] = []
    for message in messages:
        content = str(message.get("content") or "")
        if message.get("tool_calls"):
            calls = [
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                )
                + "\n</tool_call>"
                for c in message["tool_calls"]
            ]
            content = "\n".join([content, *calls]) if content else "\n".join(calls)
        if message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": str(message["role"]), "content": content})
    if tools:
        listing = "\n".join(json.dumps(tool) for tool in tools)
        prompt = HERMES_TOOL_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
