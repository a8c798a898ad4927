"""One gateway, two models on two kinds of backend: ``chat`` on the built-in engine (a tiny
target built here) and ``code``, alias ``tiny``, on the real vLLM servers of
``tests.backends.test_backend_vllm`` (its fixture: a plain and an n-gram server, from
``.venv-vllm``).

Each request is routed by its ``model`` field, answered by that model's backend and audited
with that model's versions and backend; ``GET /v1/models`` lists both; an unknown name is
OpenAI's 404 ``model_not_found``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.models.versioning import model_version
from gateway.app import load_configured_backend
from gateway.settings import Settings
from tests.api_harness import LiveGateway, fresh_database, live_gateway
from tests.backends.test_backend_vllm import NGRAM, PROMPT, Servers, direct, payloads, vllm
from tests.gateway.test_api_gateway import assert_error
from tests.tiny_models import build_model, build_tokenizer

__all__ = ["vllm"]  # the fixture, shared with tests.backends.test_backend_vllm

LOCAL, REMOTE, ALIAS = "chat", "code", "tiny"


@pytest.fixture(scope="module")
def gateway(vllm: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("vllm-models")
    local = build_model(root / "local", build_tokenizer(), seed=5)
    remote = {
        "kind": "vllm",
        "vllm_servers": [
            {"url": vllm.plain.url, "model_dir": vllm.model},
            {"url": vllm.speculative.url, "model_dir": vllm.model, "speculative_config": NGRAM},
        ],
    }
    with fresh_database() as (name, url):
        settings = Settings(
            models=[
                {"name": LOCAL, "target": local, "device": "cpu", "dtype": "float32"},
                {"name": REMOTE, "aliases": [ALIAS], "backend": remote},
            ],
            database_url=url,
            data_dir=root / "data",
            log_format="console",
        )
        with live_gateway(settings, name, load_configured_backend) as live:
            yield live


def call(gateway: LiveGateway, method: str, path: str, body: Any = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    return httpx.request(method, gateway.base_url + path, json=body, headers=headers, timeout=120)


def test_models_lists_the_built_in_and_the_vllm_model(gateway: LiveGateway, vllm: Servers) -> None:
    listed = call(gateway, "GET", "/v1/models")
    assert listed.status_code == 200, listed.text
    cards = {entry["id"]: entry for entry in listed.json()["data"]}
    assert list(cards) == [LOCAL, REMOTE]
    assert (cards[LOCAL]["aliases"], cards[REMOTE]["aliases"]) == ([], [ALIAS])
    assert cards[REMOTE]["target_version"] == model_version(vllm.model)
    assert cards[REMOTE]["speculative_methods"] == ["none", "ngram"]
    local = gateway.services.models.resolve(LOCAL).backend.card
    assert cards[LOCAL]["target_version"] == local.target_version != model_version(vllm.model)
    assert cards[LOCAL]["speculative_methods"] == list(local.available_methods)


@pytest.mark.parametrize("requested", [REMOTE, ALIAS])
def test_the_vllm_model_answers_as_vllm_and_is_audited_with_its_versions(
    gateway: LiveGateway, vllm: Servers, requested: str
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    reply = call(gateway, "POST", "/v1/completions", {"model": requested, **body})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == REMOTE
    own = direct(vllm.plain, "/v1/completions", body)
    assert reply.json()["choices"][0]["text"] == own["choices"][0]["text"]
    request = payloads(gateway, "request")[-1]
    assert (request["model"], request["backend"]) == (REMOTE, "vllm")
    assert request["target_version"] == model_version(vllm.model)
    assert request["speculative"]["default_method"] == "ngram"
    assert request["speculative"]["config"] == NGRAM
    assert payloads(gateway, "completion")[-1]["replica"] in (vllm.plain.url, vllm.speculative.url)


def test_the_built_in_model_answers_and_is_audited_with_its_versions(
    gateway: LiveGateway,
) -> None:
    messages = [{"role": "user", "content": "def add(a, b):"}]
    reply = call(
        gateway,
        "POST",
        "/v1/chat/completions",
        {"model": LOCAL, "messages": messages, "max_tokens": 4, "temperature": 0},
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == LOCAL
    card = gateway.services.models.resolve(LOCAL).backend.card
    request = payloads(gateway, "request")[-1]
    assert (request["model"], request["backend"]) == (LOCAL, "local")
    assert request["target_version"] == card.target_version
    assert request["artefacts"] == [dict(a) for a in card.artefacts]
    assert request["speculative"]["config"] == card.speculative_config
    assert payloads(gateway, "completion")[-1]["replica"] is None


def test_tokenize_routes_to_each_models_tokenizer(gateway: LiveGateway, vllm: Servers) -> None:
    remote = call(gateway, "POST", "/tokenize", {"model": ALIAS, "prompt": PROMPT})
    assert remote.status_code == 200, remote.text
    own = direct(vllm.plain, "/tokenize", {"prompt": PROMPT})
    assert remote.json()["tokens"] == own["tokens"]
    local = call(gateway, "POST", "/tokenize", {"model": LOCAL, "prompt": PROMPT})
    assert local.status_code == 200, local.text
    assert local.json()["max_model_len"] == 512


def test_an_unknown_model_is_404_and_every_model_must_be_ready(gateway: LiveGateway) -> None:
    assert_error(
        call(gateway, "POST", "/v1/completions", {"model": "gpt-4o", "prompt": "x"}),
        404,
        "model",
        "model_not_found",
    )
    ready = httpx.get(gateway.base_url + "/readyz", timeout=30)
    assert ready.status_code == 200, ready.text
    assert ready.json()["models"] == {LOCAL: True, REMOTE: True}
