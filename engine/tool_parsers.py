"""Tool calls in a model's output text, by the convention its chat template taught it.

Like vLLM's ``--tool-call-parser``: ``hermes`` (``<tool_call>{"name", "arguments"}</tool_call>``
blocks, Qwen, Hermes and the demo), ``llama3_json`` (the whole output one JSON object with
``name`` and ``parameters``), ``mistral`` (``[TOOL_CALLS]`` then a JSON list). The parser is
chosen from the template's text unless configured. No torch here: the gateway uses it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    calls: tuple[ParsedCall, ...]


def _call(value: Any, arguments_key: str) -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):
        return ParsedCall(value["name"], arguments)
    return ParsedCall(value["name"], json.dumps(arguments))


_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedOutput:
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        try:
            call = _call(json.loads(block), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            return ParsedOutput(text, ())  # not a well-formed call: leave the text as it is
        calls.append(call)
    content = text[: text.find("<tool_call>")].strip() if calls else text
    return ParsedOutput(content or None, tuple(calls))


def parse_llama3_json(text: str) -> ParsedOutput:
    stripped = text.strip().removeprefix("<|python_tag|>")
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError:
        return ParsedOutput(text, ())
    values = value if isinstance(value, list) else [value]
    calls = [_call(v, "parameters") for v in values]
    if not calls or any(call is None for call in calls):
        return ParsedOutput(text, ())
    return ParsedOutput(None, tuple(call for call in calls if call is not None))


def parse_mistral(text: str) -> ParsedOutput:
    marker = text.find("[TOOL_CALLS]")
    if marker < 0:
        return ParsedOutput(text, ())
    parsed = parse_llama3_json(text[marker + len("[TOOL_CALLS]") :])
    if not parsed.calls:
        return ParsedOutput(text, ())
    return ParsedOutput(text[:marker].strip() or None, parsed.calls)


PARSERS: dict[str, Callable[[str], ParsedOutput]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's convention calls for; Hermes where it names none (the
    convention ``engine.chat`` spells out for templates without tools)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ("ipython" in text and "<tool_call>" not in text):
        return "llama3_json"
    return "hermes"
