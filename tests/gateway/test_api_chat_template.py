"""A model without a chat template, behind the gateway: chat is a 400 naming the problem
(OpenAI's error shape), plain completions still work."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_model, build_tokenizer


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("no-template")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None  # a base model: no template in its tokenizer files
    target = build_model(root / "base", tokenizer, seed=0)
    assert not list(target.glob("chat_template*"))
    with fresh_database() as (name, url):
        settings = gateway_settings((target, None), root / "data", url)  # type: ignore[arg-type]
        with live_gateway(settings, name) as running:
            yield running


def post(live: LiveGateway, path: str, body: dict[str, object]) -> httpx.Response:
    headers = {"authorization": f"Bearer {live.keys['app']}"}
    return httpx.post(live.base_url + path, json=body, headers=headers, timeout=60)


def test_chat_without_a_template_is_a_400_naming_it(live: LiveGateway) -> None:
    chat = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = post(live, "/v1/chat/completions", chat)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "no chat template" in error["message"]
    assert error["param"] == "messages" and error["code"] == "chat_template_missing"
    assert error["type"] == "invalid_request_error"
    completion = post(live, "/v1/completions", {"model": "base", "prompt": "def", "max_tokens": 4})
    assert completion.status_code == 200
