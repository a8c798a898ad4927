"""The OpenAI-compatible API end to end: a live server, real PostgreSQL, the official client.

One server serves the whole module; the tests that take the database away come last and
put it back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, cast

import httpx
import openai
import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion
from psycopg import sql
from pydantic import BaseModel

from engine.api.types import SPECULATION_FIELDS
from gateway.audit.schema import audit_events
from gateway.audit.verify import verify_export
from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway, pg_admin
from tests.tiny_models import build_pair

MODEL = "target"
BOOTSTRAP_KEY = "sg-bootstrap-key-for-the-api-tests-0123456789"
BODY_LIMIT = 64 * 1024
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
COMPLETION = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 8}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("api")
    models = build_pair(root / "models")
    with fresh_database() as (name, url):
        settings_ = gateway_settings(
            models,
            root / "data",
            url,
            max_body_bytes=BODY_LIMIT,
            checkpoint_interval_s=1.0,
            bootstrap_admin_key=BOOTSTRAP_KEY,
        )
        with live_gateway(settings_, name) as live:
            yield live


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.base_url + "/v1", api_key=gateway.keys["app"], max_retries=0
    )


def post(
    gateway: LiveGateway, path: str, body: Any, role: str | None = "app", **kwargs: Any
) -> httpx.Response:
    headers = {"authorization": f"Bearer {gateway.keys[role]}"} if role else {}
    if isinstance(body, bytes | Iterator):
        headers["content-type"] = "application/json"
        return httpx.post(
            gateway.base_url + path, content=body, headers=headers, timeout=60, **kwargs
        )
    return httpx.post(gateway.base_url + path, json=body, headers=headers, timeout=60, **kwargs)


def get(gateway: LiveGateway, path: str, role: str | None, **params: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {gateway.keys[role]}"} if role else {}
    return httpx.get(gateway.base_url + path, headers=headers, params=params, timeout=60)


def events(gateway: LiveGateway, kind: str) -> list[sa.Row[Any]]:
    with gateway.services.db.connect() as connection:
        query = (
            sa.select(audit_events).where(audit_events.c.kind == kind).order_by(audit_events.c.seq)
        )
        return list(connection.execute(query))


def event_by_id(gateway: LiveGateway, event_id: str) -> sa.Row[Any] | None:
    with gateway.services.db.connect() as connection:
        return connection.execute(
            sa.select(audit_events).where(audit_events.c.event_id == event_id)
        ).first()


def completion_for(
    gateway: LiveGateway, request_event_id: str, wait_s: float = 0.0
) -> sa.Row[Any] | None:
    deadline = time.monotonic() + wait_s
    while True:
        found = [
            row
            for row in events(gateway, "completion")
            if row.payload["request_event_id"] == request_event_id
        ]
        if found or time.monotonic() >= deadline:
            return found[0] if found else None
        time.sleep(0.1)


def speculative_of(reply: BaseModel) -> dict[str, Any]:
    """The ``speculative`` extension object the openai client keeps as an extra field."""
    return cast(dict[str, Any], (reply.model_extra or {})["speculative"])


def chat(client: openai.OpenAI, **options: Any) -> ChatCompletion:
    """A non-streaming chat completion of ``CHAT`` with ``options`` changed."""
    return cast(ChatCompletion, client.chat.completions.create(**{**CHAT, **options}))


def committed(gateway: LiveGateway, text: str) -> str:
    """The keyed commitment to ``text`` under the deployment key (no content stored)."""
    return gateway.services.privacy.deployment_commitments.commit(text.encode("utf-8"))


def assert_error(
    response: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


# --- the official client ----------------------------------------------------------------


def test_chat_completion_with_the_openai_client(
    gateway: LiveGateway, client: openai.OpenAI
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    reply = raw.parse()
    assert reply.object == "chat.completion"
    assert reply.model == MODEL
    assert len(reply.choices) == 1
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length")
    engine = gateway.engine
    template = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = engine.tokenizer.encode(template, add_special_tokens=False)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    speculative = speculative_of(reply)
    assert speculative["method"] == "draft"
    assert set(speculative) == set(SPECULATION_FIELDS)
    if speculative["num_draft_tokens"]:
        rate = speculative["num_accepted_tokens"] / speculative["num_draft_tokens"]
        assert speculative["acceptance_rate"] == pytest.approx(rate)
    assert raw.headers["x-specgate-audit-id"]


def test_streamed_chat_matches_the_plain_answer_and_reports_usage(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "hi there"}]
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == plain.choices[0].message.content
    finishes = [
        chunk.choices[0].finish_reason
        for chunk in chunks
        if chunk.choices and chunk.choices[0].finish_reason
    ]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and plain.usage is not None
    assert chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert speculative_of(chunks[-1])["method"] == "draft"
    assert all(chunk.usage is None for chunk in chunks[:-1])


def app_stream(gateway: LiveGateway, path: str, body: dict[str, Any]) -> Any:
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    return httpx.stream("POST", gateway.base_url + path, json=body, headers=headers, timeout=60)


def test_stream_ends_with_done(gateway: LiveGateway) -> None:
    with app_stream(gateway, "/v1/chat/completions", {**CHAT, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_streamed_choices_match_the_seeded_plain_answer(gateway: LiveGateway) -> None:
    body = {**CHAT, "n": 2, "seed": 5, "temperature": 1.0}
    plain = post(gateway, "/v1/chat/completions", body).json()
    with app_stream(gateway, "/v1/chat/completions", {**body, "stream": True}) as response:
        chunks = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")
        ]
    for index in (0, 1):
        mine = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == index]
        text = "".join(choice["delta"].get("content", "") for choice in mine)
        assert text == plain["choices"][index]["message"]["content"]
        finishes = [choice["finish_reason"] for choice in mine if choice["finish_reason"]]
        assert finishes == [plain["choices"][index]["finish_reason"]]


def test_completion_with_text_and_with_the_same_token_ids(
    gateway: LiveGateway, client: openai.OpenAI
) -> None:
    prompt = "def add(a, b):"
    from_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    token_ids = gateway.engine.tokenizer.encode(prompt)
    from_ids = client.completions.create(model=MODEL, prompt=token_ids, max_tokens=8, temperature=0)
    assert from_text.object == "text_completion"
    assert from_text.choices[0].text == from_ids.choices[0].text
    assert from_text.usage is not None and from_ids.usage is not None
    assert from_text.usage.prompt_tokens == from_ids.usage.prompt_tokens == len(token_ids)


def test_streamed_completion(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt="for i in", max_tokens=6, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="for i in",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert (
        "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == plain.choices[0].text
    )
    assert chunks[-1].usage is not None and plain.usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_models_list_and_retrieve(gateway: LiveGateway, client: openai.OpenAI) -> None:
    listed = client.models.list().data
    assert [model.id for model in listed] == [MODEL]
    card = listed[0].model_extra or {}
    assert card["target_version"] == gateway.services.backend.card.target_version
    assert card["speculative_methods"] == ["none", "ngram", "draft"]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_speculation_can_be_chosen_per_request(client: openai.OpenAI) -> None:
    plain = chat(client, temperature=0, extra_body={"speculative": False})
    ngram = chat(
        client,
        temperature=0,
        extra_body={"speculative": {"method": "ngram", "num_speculative_tokens": 3}},
    )
    default = chat(client, temperature=0, extra_body={"speculative": True})
    assert speculative_of(plain)["method"] == "none"
    assert speculative_of(plain)["num_draft_tokens"] == 0
    assert speculative_of(ngram)["method"] == "ngram"
    assert speculative_of(default)["method"] == "draft"
    # Lossless: greedy output is the same whichever way it was decoded.
    texts = {reply.choices[0].message.content for reply in (plain, ngram, default)}
    assert len(texts) == 1


def test_seeded_sampling_is_reproducible_through_the_api(client: openai.OpenAI) -> None:
    def sample(seed: int, n: int = 1) -> list[str | None]:
        reply = chat(client, max_tokens=12, temperature=1.0, seed=seed, n=n)
        return [choice.message.content for choice in reply.choices]

    first = sample(7)
    assert sample(7) == first
    pair = sample(7, n=2)
    assert pair[0] == first[0]
    assert pair[1] == sample(8)[0]


def test_unknown_model_is_404_model_not_found(gateway: LiveGateway) -> None:
    assert_error(
        post(gateway, "/v1/chat/completions", {**CHAT, "model": "gpt-4o"}),
        404,
        "model",
        "model_not_found",
    )


# --- roles ------------------------------------------------------------------------------

ENDPOINTS: list[tuple[str, str, str, dict[str, Any] | None]] = [
    ("app", "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 2}),
    ("app", "POST", "/v1/completions", {**COMPLETION, "max_tokens": 2}),
    ("app", "GET", "/v1/models", None),
    ("auditor", "GET", "/v1/audit/export", None),
    ("auditor", "GET", "/v1/audit/verify", None),
    ("auditor", "GET", "/v1/audit/public-key", None),
    ("admin", "GET", "/v1/admin/keys", None),
]


@pytest.mark.parametrize(("owner", "method", "path", "body"), ENDPOINTS)
def test_role_matrix(
    gateway: LiveGateway, owner: str, method: str, path: str, body: dict[str, Any] | None
) -> None:
    def call(authorization: str | None) -> httpx.Response:
        headers = {"authorization": authorization} if authorization else {}
        return httpx.request(
            method, gateway.base_url + path, json=body, headers=headers, timeout=60
        )

    for role in ("app", "auditor", "admin"):
        response = call(f"Bearer {gateway.keys[role]}")
        if role == owner:
            assert response.status_code == 200, response.text
        else:
            assert_error(response, 403, code="insufficient_role")
    assert_error(call(None), 401, code="missing_api_key")
    assert_error(call("Bearer sg-not-a-real-key"), 401, code="invalid_api_key")
    assert call(None).headers["www-authenticate"] == "Bearer"


def test_admin_manages_keys_over_http(gateway: LiveGateway) -> None:
    created = post(
        gateway, "/v1/admin/keys", {"role": "app", "name": "made-over-http"}, role="admin"
    )
    assert created.status_code == 201, created.text
    key = created.json()["key"]
    chat = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        json={**CHAT, "max_tokens": 2},
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert chat.status_code == 200
    listed = get(gateway, "/v1/admin/keys", "admin").json()
    made = {"key_id": created.json()["key_id"], "name": "made-over-http", "role": "app"}
    assert {**made, "store_content": None} in listed
    revoked = httpx.delete(
        gateway.base_url + "/v1/admin/keys/made-over-http",
        headers={"authorization": f"Bearer {gateway.keys['admin']}"},
    )
    assert revoked.status_code == 200
    again = httpx.get(gateway.base_url + "/v1/models", headers={"authorization": f"Bearer {key}"})
    assert_error(again, 401, code="invalid_api_key")
    assert [
        row.payload["action"]
        for row in events(gateway, "key")
        if row.payload["name"] == "made-over-http"
    ] == [
        "created",
        "revoked",
    ]


def test_bootstrap_admin_key_is_stored_once(gateway: LiveGateway) -> None:
    response = httpx.get(
        gateway.base_url + "/v1/admin/keys", headers={"authorization": f"Bearer {BOOTSTRAP_KEY}"}
    )
    assert response.status_code == 200
    assert [key["role"] for key in response.json() if key["name"] == "bootstrap-admin"] == ["admin"]
    (startup,) = events(gateway, "startup")
    assert BOOTSTRAP_KEY not in json.dumps(startup.payload)
    assert startup.payload["config"]["bootstrap_admin_key_set"] is True
    assert startup.payload["target_version"] == gateway.services.backend.card.target_version
    assert startup.payload["artefacts"] == list(gateway.services.backend.card.artefacts)
    assert "draft_version" not in startup.payload  # the artefacts list alone names them


# --- bad input: always a 4xx in OpenAI's shape, naming the parameter -------------------

BAD_CHAT: list[tuple[dict[str, Any], str, str | None]] = [
    ({"temperature": 2.5}, "temperature", None),
    ({"top_p": 0}, "top_p", None),
    ({"top_k": -1}, "top_k", None),
    ({"n": 0}, "n", None),
    ({"n": 17}, "n", None),
    ({"max_tokens": 0}, "max_tokens", None),
    ({"seed": 2**64}, "seed", None),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    ({"stop": ""}, "stop", None),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ({"presence_penalty": 2.5}, "presence_penalty", None),
    ({"frequency_penalty": -3}, "frequency_penalty", None),
    ({"repetition_penalty": 0}, "repetition_penalty", None),
    ({"logit_bias": {"5": 101}}, "logit_bias", None),
    ({"logit_bias": {"five": 1}}, "logit_bias", None),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", None),
    ({"min_tokens": -1}, "min_tokens", None),
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"guided_regex": "(("}, "guided_regex", None),
    ({"guided_json": {"type": "no-such-type"}}, "guided_json", None),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", None),
    ({"speculative": {"method": "lookahead"}}, "speculative.method", None),
    (
        {"speculative": {"method": "ngram", "num_speculative_tokens": 0}},
        "speculative.num_speculative_tokens",
        None,
    ),
    ({"speculative": "yes"}, "speculative", None),
    ({"stream_options": {"include_usage": True}}, "stream_options", None),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens", None),
    ({"max_tokens": 600}, "max_tokens", "context_length_exceeded"),
    ({"messages": []}, "messages", None),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", None),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", None),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0]", None),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
        None,
    ),
    ({"frobnicate": 1}, "frobnicate", None),
]


@pytest.mark.parametrize(("change", "param", "code"), BAD_CHAT)
def test_bad_chat_parameters_are_400_naming_them(
    gateway: LiveGateway, change: dict[str, Any], param: str, code: str | None
) -> None:
    assert_error(post(gateway, "/v1/chat/completions", {**CHAT, **change}), 400, param, code)


BAD_COMPLETION: list[tuple[dict[str, Any], str]] = [
    ({"prompt": [1, 10**6]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"echo": True}, "echo"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "}"}, "suffix"),
]


@pytest.mark.parametrize(("change", "param"), BAD_COMPLETION)
def test_bad_completion_parameters_are_400_naming_them(
    gateway: LiveGateway, change: dict[str, Any], param: str
) -> None:
    assert_error(post(gateway, "/v1/completions", {**COMPLETION, **change}), 400, param)


def test_neutral_values_of_unsupported_parameters_are_accepted(gateway: LiveGateway) -> None:
    neutral = {
        "logprobs": False,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "user": "u-1",
        "max_completion_tokens": 8,
    }
    assert post(gateway, "/v1/chat/completions", {**CHAT, **neutral}).status_code == 200


@settings(max_examples=20, deadline=None)
@given(
    temperature=st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=2.000001)).filter(
        lambda x: x == x
    ),
    n=st.one_of(st.integers(max_value=0), st.integers(min_value=17)),
)
def test_out_of_range_values_name_their_parameter(
    gateway: LiveGateway, temperature: float, n: int
) -> None:
    if temperature in (float("inf"), float("-inf")):
        temperature = 1e308 if temperature > 0 else -1e308
    assert_error(
        post(gateway, "/v1/chat/completions", {**CHAT, "temperature": temperature}),
        400,
        "temperature",
    )
    assert_error(post(gateway, "/v1/completions", {**COMPLETION, "n": n}), 400, "n")


@pytest.mark.parametrize(
    "body", [b"{not json", b'{"model": "target",', b"\xff\xfe\x00{}", b"[1, 2]", b""]
)
def test_unreadable_bodies_are_400(gateway: LiveGateway, body: bytes) -> None:
    assert_error(post(gateway, "/v1/chat/completions", body), 400)


def test_oversized_bodies_are_413(gateway: LiveGateway) -> None:
    huge = {**CHAT, "messages": [{"role": "user", "content": "x" * BODY_LIMIT}]}
    assert_error(post(gateway, "/v1/chat/completions", huge), 413, code="request_too_large")

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit counts received bytes
        yield b'{"model": "target", "messages": [{"role": "user", "content": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"y" * 1024
        yield b'"}]}'

    assert_error(post(gateway, "/v1/chat/completions", chunked()), 413, code="request_too_large")


def test_unknown_routes_and_methods_answer_in_openai_shape(gateway: LiveGateway) -> None:
    assert_error(httpx.get(gateway.base_url + "/v1/engines"), 404, code="not_found")
    assert_error(
        httpx.delete(gateway.base_url + "/v1/chat/completions"), 405, code="method_not_allowed"
    )


# --- the audit trail ---------------------------------------------------------------------


def test_audit_id_names_the_request_and_its_completion(gateway: LiveGateway) -> None:
    canary = "canary-7f3a-do-not-store"
    response = post(
        gateway,
        "/v1/chat/completions",
        {
            **CHAT,
            "messages": [{"role": "user", "content": canary}],
            "temperature": 0.7,
            "seed": 3,
            "user": "end-user-9",
        },
    )
    assert response.status_code == 200
    audit_id = response.headers["x-specgate-audit-id"]
    request = event_by_id(gateway, audit_id)
    assert request is not None and request.kind == "request"
    key = gateway.services.keys.authenticate(gateway.keys["app"])
    assert key is not None
    payload = request.payload
    assert payload["key_id"] == key.key_id and payload["key_name"] == "test-app"
    assert payload["route"] == "/v1/chat/completions"
    assert payload["model"] == MODEL
    assert [(a["kind"], a["name"]) for a in payload["artefacts"]] == [("draft_model", "draft")]
    assert payload["target_version"] == gateway.services.backend.card.target_version
    assert payload["sampling"] == {
        "max_tokens": 8,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 0,
        "seed": 3,
        "seed_drawn": False,
        "min_p": 0.0,
        "stop": [],
        "stop_token_ids": [],
        "ignore_eos": False,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "n": 1,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "logit_bias": {},
        "min_tokens": 0,
        "allowed_token_ids": [],
        "bad_words": [],
        "logprobs": None,
        "constraint": None,
    }
    # The data subject is named by keyed reference only; the user id is not in the record.
    privacy = gateway.services.privacy
    assert payload["subject_ref"] == privacy.subject_ref("user:end-user-9")
    assert "end-user-9" not in json.dumps(payload)
    assert payload["prompt_tokens"] == response.json()["usage"]["prompt_tokens"]
    assert "prompt" not in payload
    completion = completion_for(gateway, audit_id)
    assert completion is not None and completion.seq > request.seq
    body = response.json()
    assert completion.payload["outcome"] == "ok"
    assert completion.payload["completion_commitments"] == [
        committed(gateway, body["choices"][0]["message"]["content"])
    ]
    assert completion.payload["completion_tokens"] == body["usage"]["completion_tokens"]
    assert (
        completion.payload["speculative"]["num_draft_tokens"]
        == body["speculative"]["num_draft_tokens"]
    )
    assert completion.payload["finish_reasons"] == [body["choices"][0]["finish_reason"]]
    export = get(gateway, "/v1/audit/export", "auditor").text
    assert canary not in export


def test_streamed_request_is_audited_before_done(gateway: LiveGateway) -> None:
    with app_stream(gateway, "/v1/completions", {**COMPLETION, "stream": True}) as response:
        audit_id = response.headers["x-specgate-audit-id"]
        text = "".join(
            json.loads(line[6:])["choices"][0]["text"]
            for line in response.iter_lines()
            if line.startswith("data: {")
        )
    completion = completion_for(gateway, audit_id)
    assert completion is not None
    assert completion.payload["outcome"] == "ok"
    assert completion.payload["completion_commitments"] == [committed(gateway, text)]


def test_abandoned_stream_is_audited_as_cancelled(gateway: LiveGateway) -> None:
    body = {**COMPLETION, "max_tokens": 480, "temperature": 0, "stream": True, "stop": None}
    with app_stream(gateway, "/v1/completions", body) as response:
        audit_id = response.headers["x-specgate-audit-id"]
        next(response.iter_lines())
    completion = completion_for(gateway, audit_id, wait_s=20)
    assert completion is not None
    assert completion.payload["outcome"] == "cancelled"
    assert completion.payload["completion_tokens"] < 480


def test_export_verifies_offline_with_the_served_public_key(gateway: LiveGateway) -> None:
    post(gateway, "/v1/completions", COMPLETION)
    public_key = get(gateway, "/v1/audit/public-key", "auditor")
    assert public_key.text.startswith("-----BEGIN PUBLIC KEY-----")
    for fmt in ("jsonl", "csv"):
        export = get(gateway, "/v1/audit/export", "auditor", format=fmt)
        assert export.status_code == 200
        report = verify_export(export.text.splitlines(keepends=True), public_key.content)
        assert report.ok, report.reason
        assert report.events_checked >= 3
    exports = events(gateway, "export")
    assert exports[-1].payload["format"] == "csv"
    assert exports[-1].actor == gateway.services.keys.authenticate(gateway.keys["auditor"]).key_id  # type: ignore[union-attr]
    verified = get(gateway, "/v1/audit/verify", "auditor").json()
    assert verified["ok"] is True and verified["first_bad_seq"] is None


def test_audit_range_parameters_are_checked(gateway: LiveGateway) -> None:
    assert_error(get(gateway, "/v1/audit/export", "auditor", since="yesterday"), 400, "since")
    assert_error(get(gateway, "/v1/audit/export", "auditor", format="xml"), 400, "format")
    later, earlier = "2030-01-02T00:00:00Z", "2030-01-01T00:00:00Z"
    assert_error(
        get(gateway, "/v1/audit/verify", "auditor", since=later, until=earlier), 400, "since"
    )
    empty = get(gateway, "/v1/audit/verify", "auditor", since=earlier, until=later).json()
    assert empty["ok"] is True and empty["events_checked"] == 0


def test_checkpoints_are_signed_in_the_background(gateway: LiveGateway) -> None:
    deadline = time.monotonic() + 10
    while not events(gateway, "checkpoint") and time.monotonic() < deadline:
        time.sleep(0.2)
    checkpoint = events(gateway, "checkpoint")[0].payload
    assert checkpoint["key_fingerprint"] == gateway.services.signer.fingerprint


# --- fail closed: these take the database away, so they run last ------------------------


def _terminate_connections(database: str) -> None:
    pg_admin(
        sql.SQL("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = {}").format(
            sql.Literal(database)
        )
    )


def test_unwritable_audit_log_refuses_requests_before_the_engine(
    gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = gateway.engine
    submitted: list[object] = []
    real_submit = engine.submit

    def spy(request: object) -> object:
        submitted.append(request)
        return real_submit(request)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "submit", spy)
    database = sql.Identifier(gateway.database)
    pg_admin(sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(database))
    _terminate_connections(gateway.database)
    try:
        assert_error(post(gateway, "/v1/chat/completions", CHAT), 503, code="audit_unavailable")
        assert submitted == []
    finally:
        pg_admin(sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(database))
        _terminate_connections(gateway.database)
    assert post(gateway, "/v1/chat/completions", CHAT).status_code == 200
    assert len(submitted) == 1


def test_unreachable_database_is_503_and_service_resumes(gateway: LiveGateway) -> None:
    database = sql.Identifier(gateway.database)
    pg_admin(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(database))
    _terminate_connections(gateway.database)
    try:
        assert_error(post(gateway, "/v1/chat/completions", CHAT), 503, code="audit_unavailable")
        ready = httpx.get(gateway.base_url + "/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"] == {
            "engine": True,
            "audit_store": False,
            "audit_integrity": True,
        }
        assert httpx.get(gateway.base_url + "/healthz").status_code == 200
    finally:
        pg_admin(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(database))
    ready = httpx.get(gateway.base_url + "/readyz")
    assert (ready.status_code, ready.json()["notes"]) == (200, [])  # a target was given
    assert post(gateway, "/v1/chat/completions", CHAT).status_code == 200
    report = get(gateway, "/v1/audit/verify", "auditor").json()
    assert report["ok"] is True
