"""Tool calls read back from output text, per convention (engine.api.tool_parsers), and the
Hermes rendering for templates without tools (engine.api.chat) that the parser must read, and the
streaming readers: any split of a text reassembles to the one-shot parse."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.api.chat import hermes_messages
from engine.api.tool_parsers import (
    READERS,
    ArgumentsDelta,
    ArgumentsReader,
    BareReader,
    CallStarted,
    ContentDelta,
    ToolCallReader,
    ToolEvent,
    _JsonValue,
    assemble,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    parser_for_template,
    read_all,
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
    assert parsed.content == (prefix.rstrip() or None)


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


# ------------------------------------------------------------------------------ streaming readers

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
call_objects = st.tuples(names, st.sampled_from(["arguments", "parameters"]), json_values).map(
    lambda c: json.dumps({"name": c[0], c[1]: c[2]})
)


def _truncations(texts: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return texts.flatmap(lambda t: st.integers(0, len(t)).map(lambda n: t[:n]))


# Whole calls in each convention, as a model writes them.
blocks = st.one_of(
    call_objects.map(lambda c: f"<tool_call>\n{c}\n</tool_call>"),
    st.lists(call_objects, min_size=1, max_size=2).map(lambda c: f"[TOOL_CALLS][{', '.join(c)}]"),
    st.lists(call_objects, min_size=1, max_size=2).map(lambda c: f"[{', '.join(c)}]"),
)
# Pieces a model might write: prose, markers, whole, cut and broken calls, whitespace.
pieces = st.one_of(
    st.text(max_size=6),
    st.sampled_from(
        ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "\n", " ", "[", "]"]
    ),
    st.sampled_from(["{", "}", ",", '"name": ', '"arguments": ', '{"name": "f"', '"x"', "1e"]),
    call_objects,
    _truncations(call_objects),
    blocks,
    _truncations(blocks),
)
model_texts = st.lists(pieces, max_size=6).map("".join)


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def _streamed(reader: ToolCallReader, parts: list[str]) -> list[ToolEvent]:
    events: list[ToolEvent] = []
    for part in parts:
        events += reader.feed(part)
    return events + reader.finish()


@pytest.mark.parametrize("parser", sorted(READERS))
@given(text=model_texts, cuts=st.lists(st.integers(0, 300), max_size=20))
def test_any_split_reassembles_to_the_one_shot_parse(
    parser: str, text: str, cuts: list[int]
) -> None:
    one_shot = read_all(READERS[parser](None), text)
    events = _streamed(READERS[parser](None), _split(text, cuts))
    assert assemble(events) == one_shot
    assert assemble(_streamed(READERS[parser](None), list(text))) == one_shot
    if not one_shot.calls:
        assert one_shot.content == (text or None)  # no call: the whole text, unchanged
    for call in one_shot.calls:
        assert call.name


@given(text=model_texts, cuts=st.lists(st.integers(0, 200), max_size=12))
def test_at_most_max_calls_are_kept_whatever_the_split(text: str, cuts: list[int]) -> None:
    whole = read_all(READERS["hermes"](None), text)
    one = assemble(_streamed(READERS["hermes"](1), _split(text, cuts)))
    assert one.calls == whole.calls[:1] and one.content == whole.content


def test_content_streams_at_once_and_a_long_call_in_argument_fragments() -> None:
    reader = READERS["hermes"](None)
    assert reader.feed("Let me check. <tool") == [ContentDelta("Let me check.")]
    assert reader.feed('_call>\n{"name": "get_weather", ') == []
    assert reader.feed('"arguments": {"city": "Be') == [
        CallStarted(0, "get_weather"),
        ArgumentsDelta(0, '{"city": "Be'),
    ]
    assert reader.feed('rn", "days": 3}}\n</tool_call>') == [ArgumentsDelta(0, 'rn", "days": 3}')]
    assert reader.finish() == []


def test_a_call_cut_short_keeps_what_was_read_and_parallel_calls_get_their_own_index() -> None:
    cut = parse_hermes('<tool_call>{"name": "f", "arguments": {"a": "x')
    assert cut.content is None and [(c.name, c.arguments) for c in cut.calls] == [("f", '{"a": "x')]
    two = BareReader(("parameters",))
    events = _streamed(
        two, ['[{"name": "a", "parameters": {}}, {"name": "b", "param', 'eters": 1}]']
    )
    assert [e for e in events if isinstance(e, CallStarted)] == [
        CallStarted(0, "a"),
        CallStarted(1, "b"),
    ]
    assert assemble(events).calls[1].arguments == "1"


def test_a_named_call_streams_its_arguments_as_written() -> None:
    reader = ArgumentsReader("get_weather")
    assert reader.feed('{"city"') == [CallStarted(0, "get_weather"), ArgumentsDelta(0, '{"city"')]
    assert reader.feed(': "Bern"}') == [ArgumentsDelta(0, ': "Bern"}')]
    assert reader.finish() == []


def _checks(text: str) -> bool:
    """Whether ``_JsonValue`` takes ``text`` as exactly one whole JSON value."""
    value = _JsonValue()
    for position, c in enumerate(text):
        step = value.push(c)
        if step == "bad":
            return False
        if step == "before":
            return False  # a character followed the value
        if step == "done":
            return position == len(text) - 1
    return value.complete_at_end()


def _loads(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@given(st.text(alphabet='{}[]",:0123456789.eE+-truefalsn \\u/abx', max_size=14))
def test_the_json_checker_agrees_with_the_json_module(text: str) -> None:
    assert _checks(text) == _loads(text) or text != text.strip()


@given(json_values)
def test_the_json_checker_takes_every_serialised_value(value: object) -> None:
    assert _checks(json.dumps(value)) and _checks(json.dumps(value, indent=1))
