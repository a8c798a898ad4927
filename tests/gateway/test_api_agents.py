"""What agent frameworks send, through real clients against a live gateway: the official
``openai`` client (structured ``parse``, streamed tool calls, logprobs), LangChain's
``ChatOpenAI`` (``bind_tools`` tool loop, ``with_structured_output``) and LiteLLM; a constraint
that does not compile (refused before anything is audited); a chat template that renders the
tools itself.

The tiny random models write nonsense, so every request that must yield valid output
constrains it (a named or required tool choice, a JSON schema with bounded strings, a regex
that spells out Hermes calls for ``auto``); what is tested is that the output validates and
the protocol round-trips.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa
from pydantic import BaseModel, Field

from engine.api.chat import HERMES_TOOL_PROMPT
from engine.api.grammar_text import checked_grammar
from gateway.audit.schema import audit_events
from gateway.backends import local as local_backend
from gateway.generation.job import constraint
from gateway.schemas import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCall
from tests.api_harness import (
    LiveGateway,
    fresh_database,
    gateway_settings,
    live_gateway,
    tools_pair_gateway,
)
from tests.gateway.test_api_gateway import events
from tests.tiny_models import build_model, build_noisy_copy, build_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=150)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    with tools_pair_gateway(tmp_path_factory.mktemp("agents")) as live:
        yield live


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.keys["app"])


MODEL = "target"


def _arguments_valid(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "days"}
    assert isinstance(value["city"], str) and len(value["city"]) <= 8
    assert 1 <= value["days"] <= 7


def test_structured_parse_gives_a_valid_model(client: openai.OpenAI) -> None:
    reply = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Who?"}],
        response_format=Person,
        max_tokens=120,
        temperature=0,
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Person)


def test_a_named_tool_call_validates_and_the_tool_loop_closes(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "Weather in Bern?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice=NAMED, max_tokens=80
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    _arguments_valid(call.function.arguments)
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 12}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert second.choices[0].message.content is not None
    assert not second.choices[0].message.tool_calls


def test_required_tool_choice_and_streamed_calls_reassemble(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    _arguments_valid(choice.message.tool_calls[0].function.arguments)


def test_logprobs_come_with_top_alternatives_and_match_plain_decoding(
    client: openai.OpenAI,
) -> None:
    replies = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "def add(a, b):"}],
            logprobs=True,
            top_logprobs=5,
            max_tokens=12,
            temperature=0,
            extra_body={"speculative": speculative},
        )
        for speculative in (False, {"method": "draft", "num_speculative_tokens": 4})
    ]
    plain, speculative = (reply.choices[0].logprobs.content for reply in replies)  # type: ignore[union-attr]
    assert plain and speculative and len(plain) == len(speculative)
    for a, b in zip(plain, speculative, strict=True):
        assert a.token == b.token and len(a.top_logprobs) == 5
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert a.logprob <= a.top_logprobs[0].logprob + 1e-6
        assert a.top_logprobs[0].logprob == pytest.approx(a.logprob, abs=1e-6)  # greedy
    assert int(replies[1].model_extra["speculative"]["num_drafts"]) > 0  # type: ignore[index]


def test_the_request_event_records_the_processors_and_the_schema_by_hash(
    client: openai.OpenAI, gateway: LiveGateway
) -> None:
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        presence_penalty=0.5,
        logit_bias={"7": -5},
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {}}},
    )
    sampling = events(gateway, "request")[-1].payload["sampling"]
    assert sampling["presence_penalty"] == 0.5 and sampling["logit_bias"] == {"7": -5.0}
    assert sampling["constraint"]["kind"] == "json_schema"
    assert len(sampling["constraint"]["sha256"]) == 64 and "spec" not in sampling["constraint"]


def test_langchain_tool_loop_and_structured_output(gateway: LiveGateway) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=MODEL,
        base_url=gateway.base_url + "/v1",
        api_key=gateway.keys["app"],  # type: ignore[arg-type]
        max_tokens=80,  # type: ignore[call-arg]
        temperature=0,
    )
    bound = chat.bind_tools([WEATHER], tool_choice="get_weather")
    messages: list[Any] = [HumanMessage("Weather in Bern?")]
    reply = bound.invoke(messages)
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"  # type: ignore[attr-defined]
    call = reply.tool_calls[0]  # type: ignore[attr-defined]
    _arguments_valid(json.dumps(call["args"]))
    messages += [reply, ToolMessage('{"temp_c": 12}', tool_call_id=call["id"])]
    answer = chat.bind_tools([WEATHER], tool_choice="none").invoke(messages)
    assert isinstance(answer.content, str)

    person = chat.with_structured_output(Person).invoke("Who?")
    assert isinstance(person, Person)


def test_litellm_completion_with_tools(gateway: LiveGateway) -> None:
    import litellm

    reply = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=gateway.base_url + "/v1",
        api_key=gateway.keys["app"],
        messages=[{"role": "user", "content": "Weather in Bern?"}],
        tools=[WEATHER],
        tool_choice=NAMED,
        max_tokens=80,
    )
    choice = reply.choices[0]  # type: ignore[union-attr]
    assert choice.finish_reason == "tool_calls"
    _arguments_valid(choice.message.tool_calls[0].function.arguments)


def test_streamed_and_completion_logprobs_cover_every_token(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "def add(a, b):"}],
        logprobs=True,
        top_logprobs=2,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    entries = []
    completion_tokens = None
    for chunk in stream:
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                entries += choice.logprobs.content
    assert completion_tokens is not None and len(entries) == completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in entries)

    legacy = client.completions.create(
        model=MODEL, prompt="def add(a, b):", max_tokens=6, logprobs=3, temperature=0
    )
    logprobs = legacy.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    assert len(logprobs.tokens) == legacy.usage.completion_tokens  # type: ignore[union-attr]
    assert logprobs.text_offset == sorted(logprobs.text_offset or [])
    assert all(len(top) <= 3 for top in logprobs.top_logprobs or [])


# ``auto`` tool choice with the model's own Hermes text: a regex spells out some content and
# two calls (the tiny model could not write them otherwise), which the Hermes reader reads.
_CALL_TEXT = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[a-z]{6,8}", "days": [1-7]\}\}\n</tool_call>'
)
TWO_CALLS = rf"I will check\. {_CALL_TEXT}\n{_CALL_TEXT}"


def _auto_request(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Bern and Basel?"}],
        "tools": [WEATHER],
        "max_tokens": 300,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"regex": TWO_CALLS}},
        **extra,
    }


def test_streamed_calls_come_as_argument_fragments_with_distinct_indexes(
    client: openai.OpenAI,
) -> None:
    order: list[str] = []
    starts: dict[int, Any] = {}
    fragments: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **_auto_request()):
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                order.append("content")
            for call in delta.tool_calls or []:
                order.append("call")
                if call.index not in starts:
                    starts[call.index] = call  # the first delta of a call names it
                    assert call.function is not None and call.function.arguments == ""
                else:
                    assert call.id is None and call.function is not None
                    assert call.function.name is None
                    fragments.setdefault(call.index, []).append(call.function.arguments or "")
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert sorted(starts) == [0, 1] and order[0] == "content"
    assert len({start.id for start in starts.values()}) == 2
    for index, start in starts.items():
        assert start.type == "function" and start.function.name == "get_weather"
        assert len(fragments[index]) > 1  # the arguments arrive as they are generated
        _arguments_valid("".join(fragments[index]))


def test_streamed_auto_calls_reassemble_to_the_non_streamed_answer(
    client: openai.OpenAI,
) -> None:
    whole = client.chat.completions.create(**_auto_request()).choices[0]
    with client.chat.completions.stream(**_auto_request()) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"
    assert whole.message.content == "I will check."
    assert (streamed.message.content or None) == whole.message.content
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    again = [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []]
    assert len(calls) == 2 and again == calls
    for _, arguments in calls:
        _arguments_valid(arguments)


def test_one_call_only_when_parallel_calls_are_off(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(**_auto_request(parallel_tool_calls=False))
    assert len(reply.choices[0].message.tool_calls or []) == 1


def _request_events(gateway: LiveGateway) -> int:
    """How many `request` events the log holds. Each is committed before its generation
    starts, so none of an earlier test's arrives late (a completion event may: a stream's
    is committed as it ends), and a request that is audited at all has one."""
    query = (
        sa.select(sa.func.count())
        .select_from(audit_events)
        .where(audit_events.c.kind == "request")
    )
    with gateway.services.db.connect() as connection:
        return int(connection.execute(query).scalar_one())


BAD_TOOL = {
    "type": "function",
    "function": {
        "name": "broken",
        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
    },
}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
        ({"guided_regex": "(", "stream": True}, "guided_regex"),
        (
            {
                "tools": [BAD_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "broken"}},
            },
            "tool_choice",
        ),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_before_anything_is_audited(
    gateway: LiveGateway, extra: dict[str, Any], param: str
) -> None:
    before = _request_events(gateway)
    reply = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {gateway.keys['app']}"},
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            **extra,
        },
        timeout=60,
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and "invalid" in error["message"]
    assert _request_events(gateway) == before  # no `request` (so no `completion` either)


# A Hermes/Qwen-style template that renders the tools, the calls and their results itself.
TOOLS_TEMPLATE = """
{%- if tools %}<|system|>
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call>. You have:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|end|>
{% elif messages[0]['role'] == 'system' %}<|system|>
{{ messages[0]['content'] }}<|end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'tool' %}<|user|>
<tool_response>
{{ message['content'] }}
</tool_response><|end|>
{% elif message['role'] == 'assistant' %}<|assistant|>
{% if message['content'] %}{{ message['content'] }}{% endif %}
{%- for call in message.get('tool_calls') or [] %}
<tool_call>
{%- set function = call['function'] %}
{"name": {{ function['name'] | tojson }}, "arguments": {{ function['arguments'] | tojson }}}
</tool_call>
{%- endfor %}<|end|>
{% elif message['role'] != 'system' %}<|{{ message['role'] }}|>
{{ message['content'] }}<|end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""


@pytest.fixture(scope="module")
def tools_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("tools-template")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    target = build_model(root / "target", tokenizer, seed=0, max_positions=2048)
    draft = build_noisy_copy(target, root / "close", noise=0.3)
    with fresh_database() as (name, url):
        settings = gateway_settings((target, draft), root / "data", url, acceptance_threshold=0.0)
        with live_gateway(settings, name) as live:
            yield live


def test_a_template_that_knows_tools_renders_them_itself_through_the_tool_loop(
    tools_gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    rendered: list[str] = []
    original = local_backend.render_chat

    def spy(*args: Any) -> str:
        text = original(*args)
        rendered.append(text)
        return text

    monkeypatch.setattr(local_backend, "render_chat", spy)
    client = openai.OpenAI(
        base_url=tools_gateway.base_url + "/v1", api_key=tools_gateway.keys["app"]
    )
    messages: list[Any] = [{"role": "user", "content": "Weather in Bern?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice=NAMED, max_tokens=80
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    _arguments_valid(call.function.arguments)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 12}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert isinstance(answer.choices[0].message.content, str)

    assert len(rendered) == 2
    tools_listed = json.dumps(WEATHER, ensure_ascii=False)
    for prompt in rendered:  # the template's own rendering, not the Hermes rewrite
        assert "# Tools" in prompt and tools_listed in prompt
        assert HERMES_TOOL_PROMPT.split(".")[0] not in prompt
    arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
    assert f'{{"name": "get_weather", "arguments": {arguments}}}' in rendered[1]
    assert '<tool_response>\n{"temp_c": 12}\n</tool_response>' in rendered[1]


# Sending a reply back as the next turn: what the ``openai`` client's objects dump (fields the
# gateway never fills, as null, and the helpers' own additions) is accepted and ignored.
FOLLOW_UP = {"role": "user", "content": "And then?"}


def _next_turn(client: openai.OpenAI, messages: list[Any], **extra: Any) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **extra)
    assert reply.choices[0].message.content is not None


def _tool_result(message: Any) -> dict[str, Any]:
    call = message.tool_calls[0]
    return {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 12}'}


def test_a_plain_reply_goes_back_as_the_next_turn(client: openai.OpenAI) -> None:
    question: Any = {"role": "user", "content": "Hello?"}
    reply = client.chat.completions.create(model=MODEL, messages=[question], max_tokens=4)
    dumped = reply.choices[0].message.model_dump()
    assert {"annotations", "refusal", "audio", "function_call"} <= dumped.keys()
    _next_turn(client, [question, dumped, FOLLOW_UP])


def test_a_forced_tool_call_goes_back_as_the_next_turn(client: openai.OpenAI) -> None:
    question: Any = {"role": "user", "content": "Weather in Bern?"}
    reply = client.chat.completions.create(
        model=MODEL, messages=[question], tools=[WEATHER], tool_choice=NAMED, max_tokens=80
    )
    message = reply.choices[0].message
    _next_turn(client, [question, message.model_dump(), _tool_result(message)], tools=[WEATHER])


def test_the_stream_helpers_final_message_goes_back_as_the_next_turn(
    client: openai.OpenAI,
) -> None:
    question: Any = {"role": "user", "content": "Weather?"}
    with client.chat.completions.stream(
        model=MODEL,
        messages=[question],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
    ) as stream:
        message = stream.get_final_completion().choices[0].message
    dumped = message.model_dump()
    assert {"index", "function"} <= dumped["tool_calls"][0].keys()
    assert "parsed_arguments" in dumped["tool_calls"][0]["function"]
    _next_turn(client, [question, dumped, _tool_result(message)], tools=[WEATHER])


def test_a_parsed_structured_reply_goes_back_as_the_next_turn(client: openai.OpenAI) -> None:
    question: Any = {"role": "user", "content": "Who?"}
    reply = client.chat.completions.parse(
        model=MODEL, messages=[question], response_format=Person, max_tokens=120, temperature=0
    )
    dumped = reply.choices[0].message.model_dump()
    assert isinstance(dumped["parsed"], dict)
    _next_turn(client, [question, dumped, FOLLOW_UP])


def test_every_field_of_openais_message_types_is_a_field_of_a_request_message() -> None:
    from openai.types.chat import ChatCompletionAssistantMessageParam, ParsedChatCompletionMessage
    from openai.types.chat.parsed_function_tool_call import ParsedFunction, ParsedFunctionToolCall

    assistant = set(ChatCompletionAssistantMessageParam.__annotations__)
    assert assistant | set(ParsedChatCompletionMessage.model_fields) <= set(
        ChatMessage.model_fields
    )
    assert set(ParsedFunctionToolCall.model_fields) | {"index"} <= set(ToolCall.model_fields)
    assert set(ParsedFunction.model_fields) <= set(FunctionCall.model_fields)


def test_a_misspelt_message_field_is_still_refused(gateway: LiveGateway) -> None:
    reply = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {gateway.keys['app']}"},
        json={"model": MODEL, "messages": [{"role": "user", "contents": "x"}], "max_tokens": 4},
        timeout=60,
    )
    assert reply.status_code == 400
    assert "messages[0].contents" in reply.json()["error"]["message"]


def test_fields_sent_back_are_ignored_and_left_out_of_the_stored_messages() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "index": 0,
        "function": {"name": "f", "arguments": "{}", "parsed_arguments": {}},
    }
    message = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "ok"}, {"type": "refusal", "refusal": "no"}],
            "tool_calls": [call],
            "annotations": [{"type": "url_citation", "url_citation": {"url": "https://x"}}],
            "parsed": {"name": "x"},
            "audio": None,
            "function_call": None,
        }
    )
    stored = message.model_dump(exclude_none=True)
    assert message.text() == "ok"
    assert stored.keys() == {"role", "content", "tool_calls"}
    assert stored["tool_calls"][0] == {
        "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}
    }  # fmt: skip
    with pytest.raises(ValueError, match="only assistant messages carry refusal parts"):
        ChatMessage.model_validate(
            {"role": "user", "content": [{"type": "refusal", "refusal": ""}]}
        )
    with pytest.raises(ValueError, match="audio"):
        ChatMessage.model_validate({"role": "assistant", "content": "a", "audio": {"id": "x"}})


# Property order is part of a schema's meaning for generation: the output follows it.
ORDERED_SCHEMA = {
    "type": "object",
    "properties": {
        "reasoning": {"type": "string", "maxLength": 6},
        "answer": {"type": "integer", "minimum": 0, "maximum": 9},
        "zeta": {"type": "boolean"},
        "alpha": {"type": "string", "maxLength": 4},
    },
    "required": ["reasoning", "answer", "zeta", "alpha"],
    "additionalProperties": False,
}


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "ordered", "schema": schema}}


def test_json_schema_output_keeps_the_schemas_property_order(
    client: openai.OpenAI, gateway: LiveGateway
) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Think, then answer."}],
        response_format=_schema_format(ORDERED_SCHEMA),  # type: ignore[arg-type]
        max_tokens=120,
        temperature=0,
    )
    content = reply.choices[0].message.content
    assert content is not None
    assert list(json.loads(content)) == ["reasoning", "answer", "zeta", "alpha"]
    # The audit record hashes the schema as it was given (what a replay must run again).
    as_given = json.dumps(ORDERED_SCHEMA, separators=(",", ":"), ensure_ascii=False)
    recorded = events(gateway, "request")[-1].payload["sampling"]["constraint"]
    assert recorded["sha256"] == hashlib.sha256(as_given.encode("utf-8")).hexdigest()


def test_schemas_differing_only_in_property_order_are_different_constraints() -> None:
    reordered = {**ORDERED_SCHEMA, "properties": dict(sorted(ORDERED_SCHEMA["properties"].items()))}
    constraints = [
        constraint(
            ChatCompletionRequest(
                model=MODEL,
                messages=[ChatMessage(role="user", content="x")],
                response_format=_schema_format(schema),  # type: ignore[arg-type]
            ),
            None,
        )
        for schema in (ORDERED_SCHEMA, reordered)
    ]
    (_, first), (_, second) = constraints  # type: ignore[misc]
    assert first != second
    assert checked_grammar(first) != checked_grammar(second)


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_forced_call_sets_the_response_format_aside_for_its_turn(
    client: openai.OpenAI, choice: Any
) -> None:
    """An agent with tools and a typed answer sends a forcing ``tool_choice`` together with
    ``response_format``: the turn is the call (the format shapes the text answer after it), as
    OpenAI takes the pair. Two constraints of another kind are still one too many."""
    person = _schema_format(Person.model_json_schema())
    messages: list[Any] = [{"role": "user", "content": "Weather in Bern?"}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice=choice,
        parallel_tool_calls=False,  # one call: `required` would otherwise allow a list
        response_format=person,  # type: ignore[arg-type]
        max_tokens=80,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    call = reply.choices[0].message.tool_calls[0]  # type: ignore[index]
    _arguments_valid(call.function.arguments)  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError, match="Only one output constraint"):
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            response_format=person,  # type: ignore[arg-type]
            extra_body={"guided_choice": ["a", "b"]},
            max_tokens=8,
        )
