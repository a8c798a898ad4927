"""vLLM's extra request fields through a live gateway: each honoured field does what vLLM's
does, every one that changes sampling or output is recorded in the `request` event, greedy
output is the same with speculation off, by draft model and by n-gram lookup, and the
fields Specgate does not implement are refused with a 400 in OpenAI's error shape that says
why (docs/agent-api.md tables them all)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.api.types import GenerationRequest, InvalidRequestError, SamplingParams
from gateway.backends.vllm_wire import completion_body
from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.gateway.test_api_gateway import events
from tests.tiny_models import build_model, build_noisy_copy, build_tokenizer

MODEL = "target"
# The tiny template, plus a variable that chat_template_kwargs can set.
TEMPLATE = (
    "{% if enable_thinking %}<|system|>\nthink first<|end|>\n{% endif %}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + "
    "'<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SPECULATION: list[Any] = [
    False,
    {"method": "draft", "num_speculative_tokens": 4},
    {"method": "ngram", "num_speculative_tokens": 3},
]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("vllm-fields")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    target = build_model(root / "target", tokenizer, seed=0)
    draft = build_noisy_copy(target, root / "close", noise=0.3)
    with fresh_database() as (name, url):
        settings = gateway_settings(
            (target, draft), root / "data", url, acceptance_threshold=0.0, fallback_min_speedup=0.0
        )
        with live_gateway(settings, name) as live:
            yield live


def post(gateway: LiveGateway, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    return httpx.post(gateway.base_url + path, json=body, headers=headers, timeout=120)


def complete(gateway: LiveGateway, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "def add(a, b):\n", "max_tokens": 16, **fields}
    response = post(gateway, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def chat(gateway: LiveGateway, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return post(gateway, "/v1/chat/completions", {**body, **fields})


def token(gateway: LiveGateway, text: str) -> int:
    (only,) = gateway.engine.tokenizer.encode(text, add_special_tokens=False)
    return int(only)


def last_request(gateway: LiveGateway) -> dict[str, Any]:
    return dict(events(gateway, "request")[-1].payload)


GREEDY_FIELDS: dict[str, dict[str, Any]] = {
    "min_p": {"min_p": 0.3},
    "allowed_token_ids": {"allowed_token_ids": list(range(40, 120))},
    "bad_words": {"bad_words": ["def", "a", "(a"]},
    "stop_token_ids": {"stop_token_ids": [40, 41, 42]},
    "ignore_eos": {"ignore_eos": True},
    "include_stop_str_in_output": {"include_stop_str_in_output": True, "stop": ["e"]},
    "skip_special_tokens": {"skip_special_tokens": False},
}


@pytest.mark.parametrize("field", list(GREEDY_FIELDS))
def test_greedy_output_is_the_same_with_and_without_speculation(
    gateway: LiveGateway, field: str
) -> None:
    replies = [
        complete(gateway, temperature=0, speculative=speculative, **GREEDY_FIELDS[field])
        for speculative in SPECULATION
    ]
    assert len({reply["choices"][0]["text"] for reply in replies}) == 1, replies
    assert len({reply["usage"]["completion_tokens"] for reply in replies}) == 1
    assert all(reply["speculative"]["num_drafts"] > 0 for reply in replies[1:])


def test_min_p_one_keeps_only_the_most_likely_token(gateway: LiveGateway) -> None:
    greedy = complete(gateway, temperature=0, ignore_eos=True)["choices"][0]["text"]
    for seed in range(3):
        sampled = complete(gateway, temperature=1.5, seed=seed, min_p=1.0, ignore_eos=True)
        assert sampled["choices"][0]["text"] == greedy
    assert last_request(gateway)["sampling"]["min_p"] == 1.0


def test_allowed_token_ids_and_bad_words_shape_the_output(gateway: LiveGateway) -> None:
    x, y = token(gateway, "x"), token(gateway, "def")
    only_x = complete(gateway, allowed_token_ids=[x], ignore_eos=True, max_tokens=5)
    assert only_x["choices"][0]["text"] == "x" * 5
    only_y = complete(gateway, allowed_token_ids=[x, y], bad_words=["x"], max_tokens=5)
    assert only_y["choices"][0]["text"] == "def" * 5
    sampling = last_request(gateway)["sampling"]
    assert sampling["allowed_token_ids"] == [x, y]
    assert sampling["bad_words"] == [[x], [token(gateway, " x")]]  # inside a sentence too
    # Nothing left to draw: the output ends (or, with ignore_eos, runs on end-of-sequence).
    nothing = complete(gateway, allowed_token_ids=[x], bad_words=["x"], max_tokens=3)
    assert nothing["choices"][0] == {**nothing["choices"][0], "text": "", "finish_reason": "stop"}
    ignoring = complete(gateway, allowed_token_ids=[x], bad_words=["x"], ignore_eos=True)
    assert ignoring["choices"][0]["finish_reason"] == "length"


def test_ignore_eos_and_stop_token_ids_decide_where_output_ends(gateway: LiveGateway) -> None:
    eos = gateway.engine.tokenizer.eos_token_id
    x = token(gateway, "x")
    ended = complete(gateway, logit_bias={str(eos): 100})
    assert ended["usage"]["completion_tokens"] == 0
    assert ended["choices"][0]["finish_reason"] == "stop"
    ignored = complete(gateway, logit_bias={str(eos): 100}, ignore_eos=True, max_tokens=6)
    assert ignored["usage"]["completion_tokens"] == 6
    assert ignored["choices"][0]["finish_reason"] == "length"
    assert last_request(gateway)["sampling"]["ignore_eos"] is True
    stopped = complete(gateway, logit_bias={str(x): 100}, stop_token_ids=[x])
    assert stopped["choices"][0]["text"] == "" and stopped["choices"][0]["finish_reason"] == "stop"
    kept = complete(
        gateway, logit_bias={str(x): 100}, stop_token_ids=[x], include_stop_str_in_output=True
    )
    assert kept["choices"][0]["text"] == "x" and kept["usage"]["completion_tokens"] == 1
    sampling = last_request(gateway)["sampling"]
    assert sampling["stop_token_ids"] == [x] and sampling["include_stop_str_in_output"] is True


def test_include_stop_str_in_output_keeps_the_stop_string(gateway: LiveGateway) -> None:
    full = complete(gateway, temperature=0, ignore_eos=True)["choices"][0]["text"]
    stop = full[4:6]
    cut = full.index(stop)
    plain = complete(gateway, temperature=0, ignore_eos=True, stop=[stop])
    kept = complete(
        gateway, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    assert plain["choices"][0]["text"] == full[:cut]
    assert kept["choices"][0]["text"] == full[: cut + len(stop)]


def test_skip_special_tokens_false_shows_them(gateway: LiveGateway) -> None:
    tokenizer = gateway.engine.tokenizer
    forced = {"logit_bias": {str(tokenizer.eos_token_id): 100}, "ignore_eos": True, "max_tokens": 3}
    assert complete(gateway, **forced)["choices"][0]["text"] == ""
    shown = complete(gateway, skip_special_tokens=False, **forced)
    assert shown["choices"][0]["text"] == tokenizer.eos_token * 3
    assert last_request(gateway)["sampling"]["skip_special_tokens"] is False


def test_chat_template_options_render_the_prompt(gateway: LiveGateway) -> None:
    def prompt_tokens(**fields: Any) -> int:
        response = chat(gateway, **fields)
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens"])

    plain = prompt_tokens()
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == plain
    thinking = prompt_tokens(chat_template_kwargs={"enable_thinking": True})
    assert thinking > plain
    recorded = last_request(gateway)["chat_template"]
    assert recorded["add_generation_prompt"] is True
    assert recorded["continue_final_message"] is False
    kwargs = recorded["chat_template_kwargs"]  # by name and hash: values are content
    assert kwargs["names"] == ["enable_thinking"] and len(kwargs["sha256"]) == 64
    assert "values" not in kwargs
    assert prompt_tokens(add_generation_prompt=False) < plain
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def add"}]
    closed = prompt_tokens(messages=turns, add_generation_prompt=False)
    continued = prompt_tokens(
        messages=turns, add_generation_prompt=False, continue_final_message=True
    )
    assert continued < closed  # the assistant's turn is left open: no end marker
    assert last_request(gateway)["chat_template"]["continue_final_message"] is True


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_p": 1.5}, "min_p"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(
    gateway: LiveGateway, fields: dict[str, Any], param: str
) -> None:
    response = chat(gateway, **fields)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or "")


def test_request_id_is_recorded_and_priority_zero_accepted(gateway: LiveGateway) -> None:
    response = chat(gateway, request_id="client-run-42", priority=0)
    assert response.status_code == 200
    assert response.json()["id"] != "client-run-42"
    assert last_request(gateway)["client_request_id"] == "client-run-42"


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("priority", 5, "first come, first served"),
        ("prompt_logprobs", 1, "prompt tokens"),
        ("return_token_ids", True, "text only"),
        ("truncate_prompt_tokens", 8, "never cut"),
        ("documents", [{"text": "x"}], "not rendered"),
    ],
)
def test_unimplemented_vllm_fields_are_refused_saying_why(
    gateway: LiveGateway, field: str, value: Any, why: str
) -> None:
    response = chat(gateway, **{field: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert field in error["message"] and why in error["message"]


def test_continuous_usage_stats_put_usage_in_every_chunk(gateway: LiveGateway) -> None:
    body = {
        "model": MODEL,
        "prompt": "def add(a, b):\n",
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    with httpx.stream(
        "POST", gateway.base_url + "/v1/completions", json=body, headers=headers, timeout=120
    ) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines if line != "[DONE]"]
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and len(counts) > 2
    assert all(chunk["usage"]["prompt_tokens"] > 0 for chunk in chunks)


def test_response_format_constrains_a_completion(gateway: LiveGateway) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}},
        "required": ["name"],
        "additionalProperties": False,
    }
    reply = complete(
        gateway,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    assert set(json.loads(reply["choices"][0]["text"])) == {"name"}
    assert last_request(gateway)["sampling"]["constraint"]["kind"] == "json_schema"


def test_a_vllm_backend_is_sent_the_fields_it_shares() -> None:
    sampling = SamplingParams(
        min_p=0.1,
        allowed_token_ids=(3, 4),
        stop_token_ids=(5,),
        ignore_eos=True,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    body = completion_body("m", GenerationRequest((1, 2), sampling))
    assert body["min_p"] == 0.1 and body["allowed_token_ids"] == [3, 4]
    assert body["stop_token_ids"] == [5] and body["ignore_eos"] is True
    assert body["include_stop_str_in_output"] is True and body["skip_special_tokens"] is False
    with pytest.raises(InvalidRequestError):
        completion_body("m", GenerationRequest((1, 2), SamplingParams(bad_words=((3,),))))
