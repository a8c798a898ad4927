"""Several models behind one gateway: two built-in engines on tiny targets, configured in a
YAML file's ``models`` list, served over real HTTP with the audit log in PostgreSQL.

``chat`` serves a target with a draft model (its default speculation: the draft); ``code``
another target, with a longer context, n-gram speculation and the aliases ``coder`` and
``fast``. Each request goes to the model its ``model`` field names, and its `request` event
records that model's versions; an unknown name is OpenAI's 404 ``model_not_found``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
import yaml
from typer.testing import CliRunner

from gateway.app import load_configured_backend
from gateway.backends.base import BackendHealth
from gateway.cli_serve import serve
from gateway.observability.egress import EgressRefusedError
from gateway.observability.telemetry import check_egress
from gateway.settings import ConfigError, Settings, load_settings
from tests.api_harness import LiveGateway, fresh_database, live_gateway
from tests.gateway.test_api_gateway import assert_error, events
from tests.tiny_models import build_model, build_pair, build_tokenizer

CHAT_CONTEXT, CODE_CONTEXT = 512, 1024
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


def models_yaml(root: Path) -> Path:
    """The configuration file: shared keys once at the top, one entry per model."""
    chat_target, chat_draft = build_pair(root / "chat")
    code_target = build_model(
        root / "code" / "target", build_tokenizer(), seed=3, max_positions=CODE_CONTEXT
    )
    config = {
        "device": "cpu",
        "dtype": "float32",
        "log_format": "console",
        "models": [
            {"name": "chat", "target": str(chat_target), "draft": str(chat_draft)},
            {
                "name": "code",
                "aliases": ["coder", "fast"],
                "target": str(code_target),
                "method": "ngram",
            },
        ],
    }
    path = root / "specgate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("models")
    config = models_yaml(root)
    with fresh_database() as (name, url):
        settings = load_settings(config, database_url=url, data_dir=root / "data")
        with live_gateway(settings, name, load_configured_backend) as live:
            yield live


def post(gateway: LiveGateway, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    return httpx.post(gateway.base_url + path, json=body, headers=headers, timeout=120)


def get(gateway: LiveGateway, path: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    return httpx.get(gateway.base_url + path, headers=headers, timeout=30)


def request_event(gateway: LiveGateway, audit_id: str) -> dict[str, Any]:
    (row,) = [row for row in events(gateway, "request") if row.event_id == audit_id]
    payload: dict[str, Any] = row.payload
    return payload


def card(gateway: LiveGateway, name: str) -> Any:
    return gateway.services.models.resolve(name).backend.card


def test_models_lists_every_model_with_its_aliases_and_methods(gateway: LiveGateway) -> None:
    listed = get(gateway, "/v1/models")
    assert listed.status_code == 200, listed.text
    cards = {entry["id"]: entry for entry in listed.json()["data"]}
    assert list(cards) == ["chat", "code"]
    assert cards["chat"]["aliases"] == []
    assert cards["code"]["aliases"] == ["coder", "fast"]
    assert cards["chat"]["speculative_methods"] == list(card(gateway, "chat").available_methods)
    assert "draft" in cards["chat"]["speculative_methods"]
    assert "draft" not in cards["code"]["speculative_methods"]
    assert cards["chat"]["target_version"] != cards["code"]["target_version"]
    assert (cards["chat"]["max_context"], cards["code"]["max_context"]) == (
        CHAT_CONTEXT,
        CODE_CONTEXT,
    )
    by_alias = get(gateway, "/v1/models/fast")
    assert by_alias.status_code == 200, by_alias.text
    assert by_alias.json() == cards["code"]


@pytest.mark.parametrize(
    ("requested", "served", "default_method"),
    [("chat", "chat", "draft"), ("code", "code", "ngram"), ("fast", "code", "ngram")],
)
def test_a_request_is_served_and_audited_by_the_model_it_names(
    gateway: LiveGateway, requested: str, served: str, default_method: str
) -> None:
    reply = post(
        gateway,
        "/v1/chat/completions",
        {"model": requested, "messages": MESSAGES, "max_tokens": 4, "temperature": 0},
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == served
    recorded = request_event(gateway, reply.headers["x-specgate-audit-id"])
    expected = card(gateway, served)
    assert (recorded["model"], recorded["backend"]) == (served, "local")
    assert recorded["target_version"] == expected.target_version
    assert recorded["artefacts"] == [dict(a) for a in expected.artefacts]
    assert recorded["speculative"]["default_method"] == default_method
    assert recorded["speculative"]["config"] == expected.speculative_config


@pytest.mark.parametrize("requested", ["chat", "coder"])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 3}),
        ("/v1/responses", {"input": "def add(a, b):", "max_output_tokens": 3}),
    ],
)
def test_completions_and_responses_route_by_model(
    gateway: LiveGateway, path: str, body: dict[str, Any], requested: str
) -> None:
    served = card(gateway, requested).model_name
    reply = post(gateway, path, {"model": requested, **body})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == served
    recorded = request_event(gateway, reply.headers["x-specgate-audit-id"])
    assert (recorded["model"], recorded["target_version"]) == (
        served,
        card(gateway, served).target_version,
    )


@pytest.mark.parametrize(("requested", "context"), [("chat", CHAT_CONTEXT), ("fast", CODE_CONTEXT)])
def test_tokenize_and_detokenize_route_by_model(
    gateway: LiveGateway, requested: str, context: int
) -> None:
    tokenized = post(gateway, "/tokenize", {"model": requested, "prompt": "def add(a, b):"})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["max_model_len"] == context
    tokens = tokenized.json()["tokens"]
    detokenized = post(gateway, "/detokenize", {"model": requested, "tokens": tokens})
    assert detokenized.status_code == 200, detokenized.text
    assert detokenized.json()["prompt"].endswith("def add(a, b):")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
        ("/v1/responses", {"input": "x", "max_output_tokens": 2}),
        ("/tokenize", {"prompt": "x"}),
        ("/detokenize", {"tokens": [1]}),
    ],
)
def test_an_unknown_model_is_404_model_not_found_on_every_route(
    gateway: LiveGateway, path: str, body: dict[str, Any]
) -> None:
    before = len(events(gateway, "request"))
    reply = post(gateway, path, {"model": "gpt-4o", **body})
    assert_error(reply, 404, "model", "model_not_found")
    assert "'chat'" in reply.json()["error"]["message"]
    assert len(events(gateway, "request")) == before
    assert_error(get(gateway, "/v1/models/gpt-4o"), 404, "model", "model_not_found")


def test_startup_records_every_model(gateway: LiveGateway) -> None:
    startup = events(gateway, "startup")[-1].payload
    assert [(m["model"], m["aliases"]) for m in startup["models"]] == [
        ("chat", []),
        ("code", ["coder", "fast"]),
    ]
    for recorded in startup["models"]:
        assert recorded["target_version"] == card(gateway, recorded["model"]).target_version
        assert recorded["backend"] == "local"


def test_ready_only_while_every_model_is(
    gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    ready = httpx.get(gateway.base_url + "/readyz", timeout=30)
    assert ready.status_code == 200, ready.text
    assert ready.json()["models"] == {"chat": True, "code": True}
    code = gateway.services.models.resolve("code").backend
    monkeypatch.setattr(code, "health", lambda: BackendHealth(False, "down for the test"))
    not_ready = httpx.get(gateway.base_url + "/readyz", timeout=30)
    assert not_ready.status_code == 503, not_ready.text
    assert not_ready.json()["checks"]["engine"] is False
    assert not_ready.json()["models"] == {"chat": True, "code": False}


@pytest.mark.parametrize("requested", ["chat", "fast"])
def test_a_replay_runs_on_the_model_that_served_the_request(
    gateway: LiveGateway, requested: str
) -> None:
    body = {"model": requested, "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}
    reply = post(gateway, "/v1/completions", {**body, "store_content": True})
    assert reply.status_code == 200, reply.text
    replayed = httpx.post(
        f"{gateway.base_url}/v1/audit/replay/{reply.headers['x-specgate-audit-id']}",
        headers={"authorization": f"Bearer {gateway.keys['auditor']}"},
        timeout=120,
    )
    assert replayed.status_code == 200, replayed.text
    report = replayed.json()
    assert (report["differences"], report["replayed"], report["match"]) == ([], True, True)


def test_metrics_carry_each_models_fallback_state_and_one_queue(gateway: LiveGateway) -> None:
    metrics = httpx.get(gateway.base_url + "/metrics", timeout=30).text
    assert 'specgate_speculation_disabled{method="draft",model="chat"} 0.0' in metrics
    assert 'specgate_speculation_disabled{method="ngram",model="code"} 0.0' in metrics
    assert "specgate_queue_depth 0.0" in metrics


# --- the configuration --------------------------------------------------------------------


def write(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_an_entry_takes_the_top_levels_keys_it_leaves_out(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        {
            "dtype": "float32",
            "max_num_seqs": 4,
            "models": [{"name": "a", "max_num_seqs": 2}, {"name": "b", "dtype": "bfloat16"}],
        },
    )
    first, second = load_settings(config).configured_models()
    assert (first.settings.served_model_name, first.settings.dtype) == ("a", "float32")
    assert (first.settings.max_num_seqs, second.settings.max_num_seqs) == (2, 4)
    assert (second.settings.served_model_name, second.settings.dtype) == ("b", "bfloat16")


def test_the_top_level_alone_is_the_one_model(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, {"served_model_name": "one", "dtype": "float32"}))
    (only,) = settings.configured_models()
    assert only.settings is settings and only.aliases == () and only.where == ""


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"models": [{"name": "a"}, {"name": "b", "aliases": ["a"]}]}, "models[0]'s already"),
        ({"served_model_name": "x", "models": [{"name": "a"}]}, "with models, use name"),
        ({"models": [{"name": "a", "backend": {"kind": "vllm"}}]}, "models.0.backend"),
        ({"models": [{"name": "a", "host": "0.0.0.0"}]}, "models.0.host"),
    ],
)
def test_a_models_list_that_cannot_be_served_is_refused(
    tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_settings(write(tmp_path, config))


def test_serve_stops_naming_the_entry_whose_model_cannot_be_loaded(tmp_path: Path) -> None:
    app = typer.Typer()
    app.command()(serve)
    missing = tmp_path / "missing"
    config = write(tmp_path, {"models": [{"name": "a", "target": str(missing)}]})
    result = CliRunner().invoke(app, ["--config", str(config)])
    assert result.exit_code == 2
    assert f"specgate serve: models[0]: target: {missing} is not a model directory" in result.output


def with_vllm_model(url: str) -> Settings:
    servers = [{"url": url, "model_version": "sha256:" + "cd" * 32}]
    remote = {"name": "remote", "backend": {"kind": "vllm", "vllm_servers": servers}}
    return Settings(models=[{"name": "local"}, remote])


def test_the_egress_guard_covers_every_models_vllm_urls() -> None:
    allowed = check_egress(with_vllm_model("http://vllm.llm.svc:8000"), {})
    assert [a.source for a in allowed] == ["models[1].backend.vllm_servers[0].url"]
    with pytest.raises(EgressRefusedError, match=r"models\[1\]\.backend\.vllm_servers\[0\]"):
        check_egress(with_vllm_model("https://api.example.com"), {})
