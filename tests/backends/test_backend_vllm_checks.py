"""What the vLLM backend records is what the replicas serve, checked against real vLLM servers
(the CPU build from ``make vllm``).

Three servers on the same tiny float32 Llama, started side by side once: ``tiny-vllm`` plain
and with n-gram speculation, and ``tiny-other``, n-gram too, serving under another name. The
gateway's speculative replica is a TCP relay in front of one of them: switching the relay to
another server, its connections cut, is a restart of the replica behind the same URL (or a
Service that now routes to another pod), with no failed health check in between.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from bench.vllm_server import VllmServer, running
from engine.models.versioning import write_manifest
from gateway.app import load_configured_backend
from gateway.audit.schema import audit_events
from gateway.backends.vllm_wire import accepted_per_position
from gateway.settings import BackendSettings, Settings
from tests.api_harness import LiveGateway, fresh_database, live_gateway
from tests.tiny_models import build_model, build_tokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
SERVED, OTHER = "tiny-vllm", "tiny-other"
HEALTH_INTERVAL_S = 1.0
# Completion prompts to try for accepted drafts (the model is random: found, not assumed).
PER_POSITION_SAMPLE = (
    r"specgate_spec_decode_num_accepted_tokens_per_pos_total"
    r'\{[^}]*position="(\d+)"[^}]*\} (\S+)'
)
PROMPTS = ["for i in range(10):\n", "def add(a, b):\n", "class Point:\n", "import os\n"]


class Relay:
    """A TCP relay on a fixed port to one server at a time; ``switch`` cuts every open
    connection, as a restart of the server behind it does."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def switch(self, target_port: int) -> None:
        with self._lock:
            self.target_port = target_port
            open_sockets, self._open = self._open, []
        for sock in open_sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._listener.close()
        self.switch(self.target_port)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                port = self.target_port
            try:
                upstream = socket.create_connection(("127.0.0.1", port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class Servers:
    def __init__(self, model: Path, plain: VllmServer, ngram: VllmServer, other: VllmServer):
        self.model, self.plain, self.ngram, self.other = model, plain, ngram, other


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    root = tmp_path_factory.mktemp("vllm-checks")
    # head_dim 32 (128 / 4): vLLM's CPU attention kernels take no head size below that.
    model = build_model(root / "tiny", build_tokenizer(), seed=0, hidden=128, layers=2)
    write_manifest(model)
    plain = VllmServer(model, SERVED, root / "plain.log")
    ngram = VllmServer(model, SERVED, root / "ngram.log", speculative_config=NGRAM)
    other = VllmServer(model, OTHER, root / "other.log", speculative_config=NGRAM)
    with running(plain, ngram, other):
        yield Servers(model, plain, ngram, other)


@pytest.fixture(scope="module")
def relay(vllm: Servers) -> Iterator[Relay]:
    relay = Relay(vllm.ngram.port)
    yield relay
    relay.close()


@pytest.fixture(scope="module")
def gateway(
    vllm: Servers, relay: Relay, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("vllm-checks-gateway")
    with fresh_database() as (name, url):
        settings = Settings(
            backend=BackendSettings.model_validate(
                {
                    "kind": "vllm",
                    "vllm_servers": [
                        {"url": vllm.plain.url, "model_dir": vllm.model},
                        {"url": relay.url, "model_dir": vllm.model, "speculative_config": NGRAM},
                    ],
                    "health_interval_s": HEALTH_INTERVAL_S,
                    "retry_interval_s": HEALTH_INTERVAL_S,
                }
            ),
            database_url=url,
            data_dir=root / "data",
            log_format="console",
            acceptance_threshold=0.0,
        )
        with live_gateway(settings, name, load_configured_backend) as running:
            yield running


def payloads(gateway: LiveGateway, kind: str) -> list[dict[str, Any]]:
    with gateway.services.db.connect() as connection:
        query = sa.select(audit_events.c.payload).where(audit_events.c.kind == kind)
        return [row.payload for row in connection.execute(query.order_by(audit_events.c.seq))]


def wait_for(predicate: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")


def checks_of(gateway: LiveGateway, url: str) -> list[dict[str, Any]]:
    return [event for event in payloads(gateway, "backend_replica_check") if event["url"] == url]


def replica_up(gateway: LiveGateway, url: str) -> float:
    metrics = httpx.get(gateway.base_url + "/metrics", timeout=10).text
    pattern = rf'specgate_backend_replica_up\{{[^}}]*url="{re.escape(url)}"[^}}]*\}} (\S+)'
    match = re.search(pattern, metrics)
    assert match is not None, metrics
    return float(match.group(1))


def complete(gateway: LiveGateway, prompt: str, **extra: Any) -> dict[str, Any]:
    reply = httpx.post(
        gateway.base_url + "/v1/completions",
        json={"model": SERVED, "prompt": prompt, "max_tokens": 24, "temperature": 0, **extra},
        headers={"authorization": f"Bearer {gateway.keys['app']}"},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def test_matching_replicas_are_admitted_with_what_they_serve(
    gateway: LiveGateway, vllm: Servers, relay: Relay
) -> None:
    (plain,) = wait_for(lambda: checks_of(gateway, vllm.plain.url))
    (speculative,) = wait_for(lambda: checks_of(gateway, relay.url))
    assert (plain["outcome"], plain["differences"]) == ("admitted", [])
    assert (speculative["outcome"], speculative["differences"]) == ("admitted", [])
    assert plain["served"]["models"] == [SERVED]
    assert plain["served"]["speculative"] is False
    assert speculative["served"]["speculative"] is True
    assert speculative["served"]["num_speculative_tokens"] == NGRAM["num_speculative_tokens"]
    assert speculative["served"]["max_model_len"] == {SERVED: vllm.ngram.max_model_len}
    assert speculative["served"]["version"]  # vLLM's own /version, recorded
    assert replica_up(gateway, vllm.plain.url) == replica_up(gateway, relay.url) == 1.0


def server_per_position(server: VllmServer) -> list[float]:
    return accepted_per_position(httpx.get(server.url + "/metrics", timeout=10).text)


def increase(after: list[float], before: list[float]) -> list[int]:
    counts = [round(a - b) for a, b in zip(after, before, strict=True)]
    while counts and not counts[-1]:
        counts.pop()
    return counts


def test_accepted_tokens_by_position_are_vllms_own(gateway: LiveGateway, vllm: Servers) -> None:
    """The response's, the `completion` event's and the metrics' accepted tokens by position
    are what vLLM counted for that request (its ``..._per_pos`` counter's increase), in the
    built-in engine's form (entry i: steps that accepted more than i tokens)."""
    for prompt in PROMPTS:
        before = server_per_position(vllm.ngram)
        speculative = complete(gateway, prompt)["speculative"]
        if speculative["num_accepted_tokens"] > 0:
            break
    else:
        raise AssertionError("no prompt had a draft token accepted")
    assert speculative["acceptance_source"] == "per_request"
    per_pos = speculative["num_accepted_tokens_per_pos"]
    counted = wait_for(
        lambda: (seen := increase(server_per_position(vllm.ngram), before)) == per_pos and seen,
        timeout_s=10,
    )
    assert per_pos == counted and sum(per_pos) == speculative["num_accepted_tokens"]
    assert per_pos[0] <= speculative["num_drafts"]
    recorded = payloads(gateway, "completion")[-1]["speculative"]
    assert recorded["num_accepted_tokens_per_pos"] == per_pos
    metrics = httpx.get(gateway.base_url + "/metrics", timeout=10).text
    series = re.findall(PER_POSITION_SAMPLE, metrics)
    assert {int(p): float(v) for p, v in series} == {i: float(n) for i, n in enumerate(per_pos)}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "Weather in Bern?"}]


def tokenize(gateway: LiveGateway, body: dict[str, Any]) -> list[int]:
    reply = httpx.post(
        gateway.base_url + "/tokenize",
        json={"model": SERVED, **body},
        headers={"authorization": f"Bearer {gateway.keys['app']}"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    tokens: list[int] = reply.json()["tokens"]
    return tokens


def test_tools_render_to_the_same_prompt_ids_on_both_backends(
    gateway: LiveGateway, vllm: Servers, tmp_path: Path
) -> None:
    """The model's template ignores ``tools`` (the demo's ChatML); both backends spell them
    out in the Hermes convention, to the same token ids."""
    with fresh_database() as (name, url):
        settings = Settings(
            target=vllm.model,
            served_model_name=SERVED,
            database_url=url,
            data_dir=tmp_path / "data",
            device="cpu",
            dtype="float32",
            log_format="console",
        )
        with live_gateway(settings, name) as local:
            body = {"messages": MESSAGES, "tools": TOOLS}
            engine_ids = tokenize(local, body)
            assert engine_ids != tokenize(local, {"messages": MESSAGES})  # the tools are shown
    assert tokenize(gateway, body) == engine_ids


def test_a_speculative_replica_restarted_without_speculation_is_refused_within_one_interval(
    gateway: LiveGateway, vllm: Servers, relay: Relay
) -> None:
    """Runs after the others: it moves the relay."""
    relay.switch(vllm.plain.port)  # restarted without --speculative-config
    switched_at = time.time()
    refused = wait_for(
        lambda: [e for e in checks_of(gateway, relay.url) if e["outcome"] == "refused"],
        timeout_s=10,
    )[0]
    assert refused["timestamp"] - switched_at <= HEALTH_INTERVAL_S + 0.5
    assert refused["differences"] == [
        "runs without speculative decoding (no vllm:spec_decode_* series)"
    ]
    assert refused["served"]["speculative"] is False
    assert replica_up(gateway, relay.url) == 0.0
    # The answer and its record say what served it: the plain pool, no speculation.
    answer = complete(gateway, PROMPTS[0])
    assert answer["speculative"]["method"] == "none"
    completion = payloads(gateway, "completion")[-1]
    assert completion["replica"] == vllm.plain.url
    assert completion["speculative"]["method"] == "none"

    relay.switch(vllm.ngram.port)  # restarted as configured: admitted again
    wait_for(lambda: checks_of(gateway, relay.url)[-1]["outcome"] == "admitted", timeout_s=10)
    wait_for(lambda: replica_up(gateway, relay.url) == 1.0, timeout_s=10)
    assert complete(gateway, PROMPTS[0])["speculative"]["method"] == "ngram"


def test_a_replica_serving_another_model_is_refused(
    gateway: LiveGateway, vllm: Servers, relay: Relay
) -> None:
    refusals_before = len([e for e in checks_of(gateway, relay.url) if e["outcome"] == "refused"])
    relay.switch(vllm.other.port)  # speculative as configured, but another model
    refused = wait_for(
        lambda: [e for e in checks_of(gateway, relay.url) if e["outcome"] == "refused"][
            refusals_before:
        ],
        timeout_s=10,
    )[0]
    assert refused["differences"] == [f"serves ['{OTHER}'], not '{SERVED}'"]
    assert replica_up(gateway, relay.url) == 0.0
    assert complete(gateway, PROMPTS[0])["speculative"]["method"] == "none"
