"""A chat's ``/tokenize`` body, so that vLLM renders tools as the built-in engine does.

vLLM's ``/tokenize`` hands ``tools`` to the chat template, and a template that does not use
them (the demo's ChatML) drops them: the model would never see the tools it is asked to
call. The built-in engine (``engine.api.chat.render_chat``) spells them out for such a template
in the Hermes convention (``engine.api.chat.hermes_messages``: the tools and the call format in
the system message, earlier calls and their results as text), which its tool-call parser
reads back. The vLLM backend sends the same messages to ``/tokenize``, so both backends give
the same prompt.

Whether the server's template uses the tools is asked of the server itself, once: a probe
chat rendered with and without a probe tool. Equal token ids mean the template ignores them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.api.chat import TemplateOptions, hermes_messages

PROBE_MESSAGES = ({"role": "user", "content": "What is the weather?"},)
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "specgate_template_probe",
        "description": "Whether the chat template renders tools.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def template_renders_tools(tokenize_chat: Callable[[dict[str, Any]], Sequence[int]]) -> bool:
    """Whether the server's chat template shows the model its tools; ``tokenize_chat`` gives
    the ids of a ``/tokenize`` chat body (without ``model``)."""
    plain = {"messages": list(PROBE_MESSAGES), "add_generation_prompt": True}
    with_tool = {**plain, "tools": [PROBE_TOOL]}
    return tuple(tokenize_chat(with_tool)) != tuple(tokenize_chat(plain))


def tokenize_chat_body(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    options: TemplateOptions,
    renders_tools: bool,
) -> dict[str, Any]:
    """The ``/tokenize`` chat body (without ``model``) that renders as the built-in engine
    would: tools to a template that uses them, else the Hermes messages."""
    rendered = [dict(m) for m in messages] if renders_tools else hermes_messages(messages, tools)
    body: dict[str, Any] = {
        "messages": rendered,
        "add_generation_prompt": options.add_generation_prompt,
        "continue_final_message": options.continue_final_message,
    }
    if options.kwargs:
        body["chat_template_kwargs"] = dict(options.kwargs)
    if tools and renders_tools:
        body["tools"] = [dict(tool) for tool in tools]
    return body
