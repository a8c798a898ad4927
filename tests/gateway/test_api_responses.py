"""``POST /v1/responses`` through the real ``openai`` client against a live gateway: text,
a forced function tool and the tool loop closed with ``function_call_output``, structured
output through ``text.format``, streams (text, a call, a cut-short output), the stateless
choices (``store`` answered false, ``previous_response_id`` refused) and the audit events,
which are the chat completion's the request translates to.

The tiny random models write nonsense, so outputs that must end on their own are constrained
(a named tool, a JSON schema with bounded strings); unconstrained ones are cut short by
``max_output_tokens`` and compared, greedy, with the chat completion of the same input.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, cast

import httpx
import openai
import pytest

from engine.api.types import SamplingParams, SpeculativeChoice
from gateway.generation.job import Job, Prompt
from gateway.responses_api import ResponseEvents
from gateway.responses_schemas import ResponseRequest
from tests.api_harness import LiveGateway, tools_pair_gateway
from tests.gateway.test_api_agents import WEATHER, Person
from tests.gateway.test_api_gateway import completion_for, event_by_id

MODEL = "target"
TOOL: Any = {"type": "function", **cast(dict[str, Any], WEATHER["function"])}
FORCED: Any = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    with tools_pair_gateway(tmp_path_factory.mktemp("responses")) as live:
        yield live


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.base_url + "/v1", api_key=gateway.keys["app"], max_retries=0
    )


def _arguments_valid(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "days"} and 1 <= value["days"] <= 7


def test_text_matches_the_chat_completion_of_the_same_input(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="Hello there",
        max_output_tokens=6,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
        ],
        max_completion_tokens=6,
        temperature=0,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete"  # the tiny model does not stop by itself
    assert response.incomplete_details and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage and chat.usage
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == 6
    assert response.to_dict()["store"] is False
    assert (response.model_extra or {})["speculative"]["method"]


def test_the_request_and_completion_are_audited_as_a_chat_completion(
    client: openai.OpenAI, gateway: LiveGateway
) -> None:
    raw = client.responses.with_raw_response.create(
        model=MODEL, input=[{"role": "user", "content": "hi"}], max_output_tokens=3
    )
    audit_id = raw.headers["x-specgate-audit-id"]
    request = event_by_id(gateway, audit_id)
    assert request is not None and request.kind == "request"
    assert request.payload["route"] == "/v1/chat/completions"
    assert "hi" not in json.dumps(request.payload)  # a commitment, not the text
    completion = completion_for(gateway, audit_id, wait_s=5)
    assert completion is not None and completion.payload["outcome"] == "ok"
    assert raw.parse().usage is not None


def test_a_forced_function_call_validates_and_the_tool_loop_closes(
    client: openai.OpenAI,
) -> None:
    first = client.responses.create(
        model=MODEL,
        input="Weather in Bern?",
        tools=[TOOL],
        tool_choice=FORCED,
        max_output_tokens=80,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    _arguments_valid(call.arguments)
    turns: list[Any] = [
        {"role": "user", "content": "Weather in Bern?"},
        *first.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"t": 12}'},
    ]
    second = client.responses.create(
        model=MODEL,
        input=turns,
        tools=[TOOL],
        tool_choice="none",
        max_output_tokens=4,
    )
    assert [item.type for item in second.output] == ["message"]
    assert isinstance(second.output_text, str)


def test_text_format_json_schema_gives_a_valid_object(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model=MODEL, input="Who?", text_format=Person, max_output_tokens=120, temperature=0
    )
    assert isinstance(parsed.output_parsed, Person)
    created = client.responses.create(
        model=MODEL,
        input="Who?",
        text={
            "format": {
                "type": "json_schema",
                "name": "person",
                "schema": {**Person.model_json_schema(), "additionalProperties": False},
                "strict": True,
            }
        },
        max_output_tokens=120,
        temperature=0,
    )
    assert created.output_text == parsed.output_text
    assert created.text and created.text.format and created.text.format.type == "json_schema"


def test_a_stream_gives_the_final_response(client: openai.OpenAI) -> None:
    deltas: list[str] = []
    kinds: list[str] = []
    with client.responses.stream(
        model=MODEL, input="Who?", text_format=Person, max_output_tokens=120, temperature=0
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert {"response.output_text.delta", "response.output_text.done"} <= set(kinds)
    assert "".join(deltas) == final.output_text
    assert isinstance(final.output_parsed, Person)
    assert final.usage and final.usage.output_tokens > 0


def test_a_streamed_function_call(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather in Bern?",
            tools=[TOOL],
            tool_choice=FORCED,
            max_output_tokens=80,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1]
    assert final.type == "response.completed"
    (call,) = [item for item in final.response.output if item.type == "function_call"]
    _arguments_valid(call.arguments)
    arguments = "".join(
        event.delta for event in events if event.type == "response.function_call_arguments.delta"
    )
    assert arguments == call.arguments


def test_a_stream_cut_short_ends_incomplete(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL, input="Hi", max_output_tokens=3, temperature=0, stream=True
        )
    )
    final = events[-1]
    assert final.type == "response.incomplete"
    assert final.response.incomplete_details is not None
    assert final.response.incomplete_details.reason == "max_output_tokens"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.response.output_text == text


def test_nothing_is_stored(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=True)
    assert response.to_dict()["store"] is False
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=MODEL, input="Hi", max_output_tokens=2, previous_response_id=response.id
        )
    assert cast(dict[str, Any], refused.value.body)["param"] == "previous_response_id"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "Hi", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"input": [{"role": "assistant", "content": [{"type": "input_text"}]}]}, "input"),
        ({"input": "Hi", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "Hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "no"}}, None),
        ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ],
)
def test_bad_requests_are_refused(
    gateway: LiveGateway, body: dict[str, Any], param: str | None
) -> None:
    answer = httpx.post(
        gateway.base_url + "/v1/responses",
        json={"model": MODEL, **body},
        headers={"authorization": f"Bearer {gateway.keys['app']}"},
        timeout=60,
    )
    assert answer.status_code == 400, answer.text
    if param is not None:
        assert answer.json()["error"]["param"].startswith(param)


def test_a_failure_mid_stream_is_an_error_event_then_response_failed() -> None:
    body = ResponseRequest(model=MODEL, input="Hi", stream=True)
    job = Job(
        kind="chat",
        request_id="r1",
        prompt=Prompt((1,), b"Hi", [], "messages"),
        sampling=[SamplingParams(max_tokens=4)],
        speculative=SpeculativeChoice(),
        stream=True,
        include_usage=True,
        user=None,
    )
    events = ResponseEvents(body, job, MODEL)
    sent = events.started()
    sent += events.chunk({"choices": [{"delta": {"content": "He"}, "finish_reason": None}]})
    error = {"message": "the engine failed", "type": "server_error", "param": None, "code": None}
    sent += events.chunk({"error": error})
    parsed = [json.loads(event.split("data: ", 1)[1]) for event in sent]
    assert [event["type"] for event in parsed][-2:] == ["error", "response.failed"]
    failed = parsed[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "the engine failed"
    assert failed["output"][0]["content"][0]["text"] == "He"
