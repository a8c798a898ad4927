"""Tool calls read back from output text, per convention (engine.tool_parsers), and the
Hermes rendering for templates without tools (engine.chat) that the parser must read."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from engine.chat import hermes_messages
from engine.tool_parsers import (
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    parser_for_template,
)

names = st.from_regex(r"[a-zA-Z0-9_-]{1,20}", fullmatch=True)
arguments = st.dictionaries(
    st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=8), st.booleans()), max_size=4
)
calls = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)


@given(st.text(max_size=30).filter(lambda t: "<tool_call>" not in t), calls)
def test_hermes_calls_round_trip_with_the_text_before_them(
    prefix: str, drawn: list[tuple[str, dict[str, object]]]
) -> None:
    text = prefix + "".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in drawn
    )
    parsed = parse_hermes(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == drawn
    assert parsed.content == (prefix.strip() or None)


@given(st.text(max_size=40).filter(lambda t: "<tool_call>" not in t))
def test_text_without_calls_stays_content(text: str) -> None:
    parsed = parse_hermes(text)
    assert parsed.calls == () and parsed.content == (text or None)


def test_a_malformed_call_is_left_as_text() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": \n</tool_call>'
    assert parse_hermes(text).calls == () and parse_hermes(text).content == text


def test_llama_and_mistral_conventions() -> None:
    llama = parse_llama3_json('{"name": "f", "parameters": {"x": 1}}')
    assert [(c.name, json.loads(c.arguments)) for c in llama.calls] == [("f", {"x": 1})]
    mistral = parse_mistral('ok [TOOL_CALLS][{"name": "g", "arguments": {"y": 2}}]')
    assert mistral.content == "ok" and mistral.calls[0].name == "g"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("<|python_tag|>") == "llama3_json"
    assert parser_for_template("<|im_start|>") == "hermes"


def test_hermes_rendering_carries_tools_calls_and_results() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    rendered = hermes_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        [tool],
    )
    assert rendered[0]["role"] == "system" and rendered[0]["content"].startswith("Be brief.")
    assert json.dumps(tool) in rendered[0]["content"]
    assert parse_hermes(rendered[2]["content"]).calls[0].name == "f"
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
