"""The gateway in front of real vLLM servers (the CPU build from ``make vllm``).

One start of two servers on the same tiny float32 Llama: a plain one and one started with
n-gram speculation (the CPU build supports it). Greedy answers through Specgate must equal
vLLM's own answers token for token, the audit records carry the version and speculative
configuration the operator gave, fallback moves requests to the plain pool and back, and a
killed replica is taken out (that test runs last: it kills the speculative server).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa
import yaml
from typer.testing import CliRunner

from bench.vllm_server import VllmServer, running
from engine.models.versioning import model_version, write_manifest
from gateway.app import load_configured_backend
from gateway.audit.schema import audit_events
from gateway.cli import app as specgate_cli
from gateway.privacy.commitments import text_bytes
from gateway.settings import Settings
from tests.api_harness import LiveGateway, fresh_database, live_gateway
from tests.tiny_models import build_model, build_tokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
SERVED = "tiny-vllm"
# Chat prompts to try: the random model ends some answers at once; the first whose answer
# runs at least MIN_TOKENS tokens is compared (found on the server, not assumed).
CHATS = ["def add(a, b):", "Hello, world!", "class Point:", "for i in range(10):", "import os"]
MIN_TOKENS = 8
PROMPT = "for i in range(10):\n"


class Servers:
    def __init__(self, model: Path, plain: VllmServer, speculative: VllmServer) -> None:
        self.model, self.plain, self.speculative = model, plain, speculative


@pytest.fixture(scope="module")  # the only module that needs them: stopped once it is done
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    root = tmp_path_factory.mktemp("vllm")
    # head_dim 32 (128 / 4): vLLM's CPU attention kernels take no head size below that.
    model = build_model(root / "tiny", build_tokenizer(), seed=0, hidden=128, layers=2)
    write_manifest(model)
    plain = VllmServer(model, SERVED, root / "plain.log")
    speculative = VllmServer(model, SERVED, root / "ngram.log", speculative_config=NGRAM)
    with running(plain, speculative):
        yield Servers(model, plain, speculative)


def vllm_settings(servers: Servers, data: Path, database_url: str, **extra: Any) -> Settings:
    return Settings(
        backend={
            "kind": "vllm",
            "vllm_servers": [
                {"url": servers.plain.url, "model_dir": servers.model},
                {
                    "url": servers.speculative.url,
                    "model_dir": servers.model,
                    "speculative_config": NGRAM,
                },
            ],
            "health_interval_s": 0.5,
            "retry_interval_s": 0.5,
        },
        database_url=database_url,
        data_dir=data,
        log_format="console",
        **extra,
    )


@pytest.fixture(scope="module")
def gateway(vllm: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("vllm-gateway")
    with fresh_database() as (name, url):
        settings = vllm_settings(vllm, root / "data", url)
        with live_gateway(settings, name, load_configured_backend) as running:
            yield running


def client(gateway: LiveGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.keys["app"])


def payloads(gateway: LiveGateway, kind: str) -> list[dict[str, Any]]:
    with gateway.services.db.connect() as connection:
        query = sa.select(audit_events.c.payload).where(audit_events.c.kind == kind)
        return [row.payload for row in connection.execute(query.order_by(audit_events.c.seq))]


def direct(server: VllmServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own answer, asked directly."""
    reply = httpx.post(server.url + path, json={"model": SERVED, **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


def streamed_text(stream: Any, chat: bool) -> tuple[str, int]:
    text, usage = "", 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
    return text, usage


@pytest.fixture(scope="module")
def chat_case(vllm: Servers) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """Messages whose greedy answer is long enough to compare, and vLLM's own answer."""
    for content in CHATS:
        messages = [{"role": "user", "content": content}]
        own = direct(
            vllm.plain,
            "/v1/chat/completions",
            {"messages": messages, "max_tokens": 24, "temperature": 0, "return_token_ids": True},
        )
        if own["usage"]["completion_tokens"] >= MIN_TOKENS:
            return messages, own
    raise AssertionError("no chat prompt gets an answer of MIN_TOKENS tokens from the model")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("speculative", [False, True])
def test_chat_equals_vllm_token_for_token(
    gateway: LiveGateway,
    chat_case: tuple[list[dict[str, str]], dict[str, Any]],
    stream: bool,
    speculative: bool,
) -> None:
    messages, own = chat_case
    expected = own["choices"][0]["message"]["content"]
    extra = {"speculative": speculative}
    api = client(gateway)
    if stream:
        text, tokens = streamed_text(
            api.chat.completions.create(
                model=SERVED, messages=messages, max_tokens=24, temperature=0, stream=True,  # type: ignore[arg-type]
                stream_options={"include_usage": True}, extra_body=extra,
            ),
            chat=True,
        )  # fmt: skip
    else:
        reply = api.chat.completions.create(
            model=SERVED, messages=messages, max_tokens=24, temperature=0, extra_body=extra,  # type: ignore[arg-type]
        )  # fmt: skip
        text, tokens = reply.choices[0].message.content or "", reply.usage.completion_tokens  # type: ignore[union-attr]
    assert (text, tokens) == (expected, len(own["choices"][0]["token_ids"]))


@pytest.fixture(scope="module")
def completion_case(vllm: Servers) -> tuple[str, dict[str, Any]]:
    for prompt in [PROMPT, *CHATS]:
        own = direct(
            vllm.plain,
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True},
        )
        if own["usage"]["completion_tokens"] >= MIN_TOKENS:
            return prompt, own
    raise AssertionError("no prompt gets a completion of MIN_TOKENS tokens from the model")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("speculative", [False, True])
def test_completions_equal_vllm_token_for_token(
    gateway: LiveGateway,
    completion_case: tuple[str, dict[str, Any]],
    stream: bool,
    speculative: bool,
) -> None:
    prompt, own = completion_case
    api = client(gateway)
    extra = {"speculative": speculative}
    if stream:
        text, tokens = streamed_text(
            api.completions.create(
                model=SERVED, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body=extra,
            ),
            chat=False,
        )  # fmt: skip
    else:
        reply = api.completions.create(
            model=SERVED, prompt=prompt, max_tokens=24, temperature=0, extra_body=extra
        )
        text, tokens = reply.choices[0].text, reply.usage.completion_tokens  # type: ignore[union-attr]
    assert (text, tokens) == (own["choices"][0]["text"], len(own["choices"][0]["token_ids"]))


def ask(gateway: LiveGateway, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Specgate's answer as JSON objects: the one body, or each streamed chunk."""
    headers = {"Authorization": f"Bearer {gateway.keys['app']}"}
    url, payload = gateway.base_url + path, {"model": SERVED, **body}
    if not body.get("stream"):
        reply = httpx.post(url, json=payload, headers=headers, timeout=120)
        assert reply.status_code == 200, reply.text
        return [reply.json()]
    with httpx.stream("POST", url, json=payload, headers=headers, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line[5:].strip() for line in reply.iter_lines() if line.startswith("data:")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def distinct_texts(entry: dict[str, Any]) -> bool:
    texts = [top["token"] for top in entry["top_logprobs"]]
    return len(set(texts)) == len(texts)


@pytest.mark.parametrize("speculative", [False, True])
def test_logprobs_equal_vllm_own(
    gateway: LiveGateway,
    vllm: Servers,
    chat_case: tuple[list[dict[str, str]], dict[str, Any]],
    completion_case: tuple[str, dict[str, Any]],
    speculative: bool,
) -> None:
    """Logprobs through Specgate are vLLM's own, on the pool the request went to: completions
    exactly; streamed chat token for token, with the alternatives too wherever their texts
    differ (vLLM's completions endpoint, which the backend calls, merges alternatives of the
    same text; docs/vllm.md)."""
    server = vllm.speculative if speculative else vllm.plain
    prompt, _ = completion_case
    legacy = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 2}
    own = direct(server, "/v1/completions", legacy)["choices"][0]["logprobs"]
    (answer,) = ask(gateway, "/v1/completions", {**legacy, "speculative": speculative})
    assert answer["choices"][0]["logprobs"] == own
    assert payloads(gateway, "completion")[-1]["replica"] == server.url

    messages, _ = chat_case
    chat = {"messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}  # fmt: skip
    own_chat = direct(server, "/v1/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    chunks = ask(gateway, "/v1/chat/completions", {**chat, "stream": True,
                                                   "speculative": speculative})  # fmt: skip
    streamed = [
        entry
        for chunk in chunks
        for choice in chunk["choices"]
        for entry in (choice.get("logprobs") or {}).get("content") or []
    ]
    chosen = ("token", "logprob", "bytes")
    assert [[e[k] for k in chosen] for e in streamed] == [[e[k] for k in chosen] for e in own_chat]
    compared = [
        (mine, theirs)
        for mine, theirs in zip(streamed, own_chat, strict=True)
        if distinct_texts(theirs)
    ]
    assert compared, "no position with distinct alternatives to compare"
    for mine, theirs in compared:
        assert mine["top_logprobs"] == theirs["top_logprobs"]


def test_audit_records_carry_version_and_speculative_config(
    gateway: LiveGateway, vllm: Servers
) -> None:
    api = client(gateway)
    reply = api.completions.create(model=SERVED, prompt=PROMPT, max_tokens=16, temperature=0)
    version = model_version(vllm.model)  # what the built-in engine would record
    (startup,) = payloads(gateway, "startup")
    assert startup["target_version"] == version
    assert startup["speculative_config"] == NGRAM
    assert startup["available_methods"] == ["none", "ngram"]
    request = payloads(gateway, "request")[-1]
    assert (request["model"], request["target_version"]) == (SERVED, version)
    assert request["speculative"]["default_method"] == "ngram"
    completion = payloads(gateway, "completion")[-1]
    assert completion["replica"] == vllm.speculative.url
    spec = completion["speculative"]
    # vLLM reported this request's own figures (--per-request-spec-decode-metrics).
    assert spec["acceptance_source"] == "per_request"
    assert spec["method"] == "ngram" and spec["num_draft_tokens"] > 0
    assert spec["num_accepted_tokens"] == reply.model_extra["speculative"]["num_accepted_tokens"]  # type: ignore[index]


def test_speculative_false_goes_to_the_plain_pool(gateway: LiveGateway, vllm: Servers) -> None:
    client(gateway).completions.create(
        model=SERVED, prompt=PROMPT, max_tokens=4, extra_body={"speculative": False}
    )
    completion = payloads(gateway, "completion")[-1]
    assert completion["replica"] == vllm.plain.url
    assert completion["speculative"]["method"] == "none"


def acceptance(server: VllmServer, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
    reply = direct(server, "/v1/completions", body)
    return float(reply["metrics"]["speculative_decoding"]["draft_acceptance_rate"])


def wait_for(predicate: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_fallback_switches_pools_and_back(vllm: Servers, tmp_path: Path) -> None:
    # Prompts whose greedy continuation n-gram lookup predicts badly and well, as measured
    # on the server itself (the model is random: which is which is found, not assumed).
    candidates = [
        [10, 50, 90, 130, 170, 210, 250, 290],
        [300, 7, 88, 151, 19, 240, 3, 77, 199],
        [4, 205, 291, 282, 304, 6, 205, 5, 205],
        [33, 66, 99, 132, 165, 198, 231, 264, 297, 12],
    ]
    rates = sorted((acceptance(vllm.speculative, p), p) for p in candidates)
    (low_rate, low), (high_rate, high) = rates[0], rates[-1]
    threshold = 0.9
    assert low_rate < threshold <= high_rate, rates
    with fresh_database() as (name, url):
        settings = vllm_settings(
            vllm,
            tmp_path / "data",
            url,
            acceptance_thresholds={"ngram": threshold},
            fallback_window_tokens=8,
            fallback_probe_interval=2,
        )
        with live_gateway(settings, name, load_configured_backend) as gateway:
            api = client(gateway)

            def send(prompt: list[int]) -> dict[str, Any]:
                api.completions.create(model=SERVED, prompt=prompt, max_tokens=24, temperature=0)
                return payloads(gateway, "completion")[-1]

            for _ in range(4):
                send(low)
                if gateway.services.backend.fallback_state()["ngram"]:
                    break
            assert gateway.services.backend.fallback_state() == {"ngram": True}
            switched = send(low)
            assert switched["replica"] == vllm.plain.url and switched["fallback_active"]
            disabled = wait_for(lambda: payloads(gateway, "fallback"))
            assert disabled[0]["action"] == "disabled" and disabled[0]["method"] == "ngram"
            assert disabled[0]["acceptance_rate"] < threshold
            # Every 2nd request probes the speculative pool; a good window switches back.
            for _ in range(8):
                send(high)
                if not gateway.services.backend.fallback_state()["ngram"]:
                    break
            assert gateway.services.backend.fallback_state() == {"ngram": False}
            back = send(high)
            assert back["replica"] == vllm.speculative.url and not back["fallback_active"]
            events = wait_for(
                lambda: len(payloads(gateway, "fallback")) >= 2 and payloads(gateway, "fallback")
            )
            assert [e["action"] for e in events] == ["disabled", "enabled"]


def requests_answered(servers: Servers) -> dict[str, float]:
    """Requests both servers answered so far, by handler: vLLM's own Prometheus counter
    (``http_requests_total``; its health and metrics handlers are not counted)."""
    counts: dict[str, float] = {}
    for server in (servers.plain, servers.speculative):
        for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("http_requests_total{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
                handler = labels["handler"]
                counts[handler] = counts.get(handler, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def requests_since(servers: Servers, before: dict[str, float], expected: dict[str, float]) -> Any:
    """The requests the servers answered since ``before``; waits (up to 30 s) for them to
    reach ``expected``, since vLLM counts a stream once it has sent its end."""
    deadline = time.monotonic() + 30
    while True:
        now = requests_answered(servers)
        seen = {k: now[k] - before.get(k, 0.0) for k in now if now[k] != before.get(k, 0.0)}
        if seen == expected or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def test_a_request_reaches_vllm_with_one_round_trip_before_generation(
    gateway: LiveGateway,
    vllm: Servers,
    chat_case: tuple[list[dict[str, str]], dict[str, Any]],
    completion_case: tuple[str, dict[str, Any]],
) -> None:
    """With ``model_dir`` the gateway decodes the rendered prompt and tokenizes completion
    prompts with the model's tokenizer (checked against the server at start-up): a chat costs
    vLLM one ``/tokenize`` before the generation, not also a ``/detokenize``; a completion
    prompt nothing before it. The answers stay vLLM's own."""
    messages, own = chat_case
    api = client(gateway)
    before = requests_answered(vllm)
    reply = api.chat.completions.create(model=SERVED, messages=messages, max_tokens=24,  # type: ignore[arg-type]
                                        temperature=0)  # fmt: skip
    assert reply.choices[0].message.content == own["choices"][0]["message"]["content"]
    expected = {"/tokenize": 1.0, "/v1/completions": 1.0}
    assert requests_since(vllm, before, expected) == expected
    prompt, own_completion = completion_case
    before = requests_answered(vllm)
    answer = api.completions.create(model=SERVED, prompt=prompt, max_tokens=24, temperature=0)
    assert answer.choices[0].text == own_completion["choices"][0]["text"]
    assert requests_since(vllm, before, {"/v1/completions": 1.0}) == {"/v1/completions": 1.0}


def test_the_chat_prompt_commitment_is_to_the_servers_own_text(
    gateway: LiveGateway,
    vllm: Servers,
    chat_case: tuple[list[dict[str, str]], dict[str, Any]],
) -> None:
    """The `request` event commits to vLLM's own ``/detokenize`` of its rendered prompt,
    whether that text came from the server or from the tokenizer beside the gateway."""
    messages, _ = chat_case
    client(gateway).chat.completions.create(model=SERVED, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    ids = direct(vllm.plain, "/tokenize", {"messages": messages, "add_generation_prompt": True})
    text = direct(vllm.plain, "/detokenize", {"tokens": ids["tokens"]})["prompt"]
    request = payloads(gateway, "request")[-1]
    commitments = gateway.services.privacy.deployment_commitments
    assert request["prompt_commitment"] == commitments.commit(text_bytes(text))
    assert request["prompt_tokens"] == len(ids["tokens"])


def test_a_tokenizer_that_answers_otherwise_is_not_used(vllm: Servers, tmp_path: Path) -> None:
    """A ``model_dir`` whose tokenizer encodes the probe otherwise than the server (its
    merges dropped) is not used: the gateway asks the server, and its answers and records
    stay the server's."""
    other = tmp_path / "other-tokenizer"
    shutil.copytree(vllm.model, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["model"]["merges"] = []
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    version = model_version(vllm.model)
    with fresh_database() as (name, url):
        settings = Settings(
            backend={
                "kind": "vllm",
                "vllm_servers": [
                    {"url": vllm.plain.url, "model_version": version, "model_dir": other}
                ],
            },
            database_url=url,
            data_dir=tmp_path / "data",
            log_format="console",
        )
        with live_gateway(settings, name, load_configured_backend) as gateway:
            api = client(gateway)
            before = requests_answered(vllm)
            api.completions.create(model=SERVED, prompt=PROMPT, max_tokens=4, temperature=0)
            expected = {"/tokenize": 1.0, "/v1/completions": 1.0}
            assert requests_since(vllm, before, expected) == expected
            messages = [{"role": "user", "content": CHATS[0]}]
            before = requests_answered(vllm)
            api.chat.completions.create(model=SERVED, messages=messages, max_tokens=4)  # type: ignore[arg-type]
            expected = {"/tokenize": 1.0, "/detokenize": 1.0, "/v1/completions": 1.0}
            assert requests_since(vllm, before, expected) == expected


def test_tune_measure_replays_recorded_requests_on_each_pool(vllm: Servers, tmp_path: Path) -> None:
    """`specgate tune measure` replays the requests recorded through a gateway over the vLLM
    servers on each pool directly: a plain and an n-gram row per workload cluster, vLLM's own
    acceptance for the n-gram pool, a recommendation that `tune apply` writes, and the
    gateway honours the model's `method: none`."""
    data = tmp_path / "data"
    with fresh_database() as (name, url):
        settings = vllm_settings(vllm, data, url, store_content=True)
        with live_gateway(settings, name, load_configured_backend) as live:
            support = live.services.keys.create("app", "support-bot", "tests")[1]
            code = live.services.keys.create("app", "code-assistant", "tests")[1]
            bodies = [(support, "/v1/chat/completions", {"messages": [{"role": "user",
                                                                     "content": c}]})
                      for c in CHATS[:3]]  # fmt: skip
            bodies += [(code, "/v1/completions", {"prompt": p}) for p in (PROMPT, CHATS[2])]
            for key, route, body in bodies:
                reply = httpx.post(
                    live.base_url + route,
                    json={"model": SERVED, "max_tokens": 12, "temperature": 0, **body},
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=120,
                )
                assert reply.status_code == 200, reply.text
        config = tmp_path / "gateway.yaml"
        block = settings.backend.model_dump(mode="json", exclude_defaults=True)
        document = {"backend": block, "database_url": url, "data_dir": str(data),
                    "store_content": True}  # fmt: skip
        config.write_text(yaml.safe_dump(document))
        out = tmp_path / "tune"
        measured = CliRunner().invoke(
            specgate_cli,
            ["tune", "measure", "--config", str(config), "--out", str(out), "--max-tokens", "12"],
        )
        assert measured.exit_code == 0, measured.output
        report = json.loads((out / "tune.json").read_text())
        (model,) = report["models"]
        assert (model["name"], model["backend"]) == (SERVED, "vllm")
        assert model["methods"] == ["none", "ngram"]
        assert model["requests"] == len(bodies)
        clusters = {c["cluster"]: c for c in model["clusters"]}
        assert set(clusters) == {
            "all", "/v1/chat/completions support-bot", "/v1/completions code-assistant"
        }
        for cluster in clusters.values():
            rows = {(row["method"], row["k"]): row for row in cluster["rows"]}
            assert set(rows) == {("none", None), ("ngram", NGRAM["num_speculative_tokens"])}
            assert rows[("none", None)]["variant"].endswith(f"({vllm.plain.url})")
            ngram = rows[("ngram", NGRAM["num_speculative_tokens"])]
            assert ngram["variant"].endswith(f"({vllm.speculative.url})")
            assert ngram["draft_tokens"] > 0
            assert 0.0 <= ngram["acceptance_rate"] <= 1.0
            for row in rows.values():
                assert row["tokens_per_second"] > 0
                assert row["speedup_low"] <= row["speedup"] <= row["speedup_high"]
            assert cluster["recommendation"]["verdict"] in ("on", "off", "no_gain_shown")
        recommendation = model["recommendation"]
        assert recommendation["method"] in ("none", "ngram")
        applied = CliRunner().invoke(
            specgate_cli, ["tune", "apply", "--report", str(out / "tune.json"),
                           "--config", str(config)],
        )  # fmt: skip
        assert applied.exit_code == 0, applied.output
        assert yaml.safe_load(config.read_text())["method"] == recommendation["method"]
        # Where the recommendation is `none`, requests go to the plain pool unless they name
        # the speculative pool's method.
        off = vllm_settings(vllm, data, url, store_content=True, method="none")
        with live_gateway(off, name, load_configured_backend, key_prefix="off") as live:
            for asked, server in ((None, vllm.plain), ({"method": "ngram"}, vllm.speculative)):
                extra = {"speculative": asked} if asked else {}
                client(live).completions.create(
                    model=SERVED, prompt=PROMPT, max_tokens=4, extra_body=extra
                )
                assert payloads(live, "completion")[-1]["replica"] == server.url


def test_a_killed_replica_is_taken_out(gateway: LiveGateway, vllm: Servers) -> None:
    """Runs last in this module: the speculative server does not come back."""
    vllm.speculative.kill()
    api = client(gateway)
    # Speculation is lossless, so with its pool gone a request is served by the plain pool.
    for _ in range(3):
        reply = api.completions.create(model=SERVED, prompt=PROMPT, max_tokens=4, temperature=0)
        assert reply.choices[0].text is not None
        assert payloads(gateway, "completion")[-1]["replica"] == vllm.plain.url
    removed = wait_for(lambda: payloads(gateway, "backend_replica"))
    assert removed[0]["url"] == vllm.speculative.url and removed[0]["action"] == "removed"
    assert removed[0]["pool"] == "speculative"
    metrics = httpx.get(gateway.base_url + "/metrics", timeout=10).text
    up = {
        line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("specgate_backend_replica_up{")
    }
    assert up == {
        f'pool="plain",url="{vllm.plain.url}"': 1.0,
        f'pool="speculative",url="{vllm.speculative.url}"': 0.0,
    }, up
    changes = [line for line in metrics.splitlines() if "replica_changes_total{" in line]
    assert any('action="removed"' in line and line.endswith(" 1.0") for line in changes)
    ready = httpx.get(gateway.base_url + "/readyz", timeout=10)
    assert ready.status_code == 200, ready.text  # the plain pool still serves
