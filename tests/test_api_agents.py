"""What agent frameworks send, through real clients against a live gateway: the official
``openai`` client (structured ``parse``, streamed tool calls, logprobs), LangChain's
``ChatOpenAI`` (``bind_tools`` tool loop, ``with_structured_output``) and LiteLLM.

The tiny random models write nonsense, so every request that must yield valid output
constrains it (a named or required tool choice, a JSON schema with bounded strings); what is
tested is that the output validates and the protocol round-trips.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.test_api_gateway import events
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
    root = tmp_path_factory.mktemp("agents")
    # A longer context than build_pair's: the tools' system prompt alone is ~600 tiny tokens.
    target = build_model(root / "target", build_tokenizer(), seed=0, max_positions=2048)
    draft = build_noisy_copy(target, root / "close", noise=0.3)
    with fresh_database() as (name, url):
        settings = gateway_settings(
            (target, draft), root / "data", url, acceptance_threshold=0.0, fallback_min_speedup=0.0
        )
        with live_gateway(settings, name) as live:
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
