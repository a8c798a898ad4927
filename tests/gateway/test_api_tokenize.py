"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` on a live gateway: counts match what
generation sees (a completion's and a chat completion's ``prompt_tokens``, tools included),
tokens decode back to the prompt, the app role is required, and nothing is audited."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.gateway.test_api_agents import WEATHER
from tests.gateway.test_api_gateway import events
from tests.tiny_models import build_model, build_tokenizer

MODEL = "target"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Bern?"},
]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("tokenize")
    # A context long enough for the tools' system prompt (~600 tiny tokens).
    target = build_model(root / "target", build_tokenizer(), seed=0, max_positions=2048)
    with fresh_database() as (name, url):
        settings = gateway_settings((target, target), root / "data", url)
        with live_gateway(settings, name) as live:
            yield live


def post(gateway: LiveGateway, path: str, body: dict[str, Any], role: str = "app") -> Any:
    headers = {"authorization": f"Bearer {gateway.keys[role]}"}
    return httpx.post(gateway.base_url + path, json=body, headers=headers, timeout=60)


def test_a_prompt_counts_as_a_completion_sees_it_and_decodes_back(gateway: LiveGateway) -> None:
    prompt = "def add(a, b):"
    tokenized = post(gateway, "/tokenize", {"model": MODEL, "prompt": prompt})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert set(body) == {"count", "max_model_len", "tokens"}
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == gateway.services.backend.card.max_context
    completion = post(
        gateway, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    )
    assert completion.json()["usage"]["prompt_tokens"] == body["count"]
    detokenized = post(gateway, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert detokenized.status_code == 200, detokenized.text
    assert detokenized.json()["prompt"].endswith(prompt)


@pytest.mark.parametrize("tools", [None, [WEATHER]])
def test_messages_count_as_a_chat_completion_sees_them(
    gateway: LiveGateway, tools: list[dict[str, Any]] | None
) -> None:
    request: dict[str, Any] = {"model": MODEL, "messages": MESSAGES}
    if tools:
        request["tools"] = tools
    tokenized = post(gateway, "/tokenize", {**request, "add_generation_prompt": True})
    assert tokenized.status_code == 200, tokenized.text
    chat = post(gateway, "/v1/chat/completions", {**request, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert tokenized.json()["count"] == chat.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "options",
    [
        {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True},
    ],
)
def test_template_options_count_as_a_chat_completion_with_them_sees(
    gateway: LiveGateway, options: dict[str, Any]
) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    request = {"model": MODEL, "messages": messages, **options}
    tokenized = post(gateway, "/tokenize", request)
    assert tokenized.status_code == 200, tokenized.text
    chat = post(gateway, "/v1/chat/completions", {**request, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert tokenized.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    default = post(gateway, "/tokenize", {"model": MODEL, "messages": messages})
    assert default.json()["tokens"] != tokenized.json()["tokens"]


def test_tokenizing_leaves_no_audit_event(gateway: LiveGateway) -> None:
    before = len(events(gateway, "request"))
    assert post(gateway, "/tokenize", {"model": MODEL, "prompt": "hello"}).status_code == 200
    assert post(gateway, "/detokenize", {"model": MODEL, "tokens": [1, 2]}).status_code == 200
    assert len(events(gateway, "request")) == before


def test_only_app_keys_tokenize(gateway: LiveGateway) -> None:
    body = {"model": MODEL, "prompt": "hello"}
    assert post(gateway, "/tokenize", body, role="auditor").status_code == 403
    assert post(gateway, "/detokenize", {"model": MODEL, "tokens": [1]}, "admin").status_code == 403
    assert httpx.post(gateway.base_url + "/tokenize", json=body).status_code == 401


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/tokenize", {"model": "other", "prompt": "hi"}, 404),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404),
        ("/detokenize", {"model": MODEL, "tokens": [10**9]}, 400),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400),
        ("/tokenize", {"model": MODEL, "prompt": "hi", "add_special_tokens": False}, 400),
        ("/tokenize", {"model": MODEL, "messages": MESSAGES, "continue_final_message": True}, 400),
        ("/tokenize", {"model": MODEL, "prompt": "hi", "messages": MESSAGES}, 400),
    ],
)
def test_bad_requests_are_refused(
    gateway: LiveGateway, path: str, body: dict[str, Any], status: int
) -> None:
    answer = post(gateway, path, body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["message"]
