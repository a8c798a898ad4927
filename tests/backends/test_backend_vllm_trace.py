"""The trace continues into vLLM: every request the gateway sends a replica carries the W3C
``traceparent`` of the gateway's own span. A stub HTTP server stands in for the replica (a
real vLLM server does not show the headers it received); the gateway's spans go to a real
OTLP receiver."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import load_configured_backend
from gateway.settings import BackendSettings, Settings
from tests.api_harness import LiveGateway, fresh_database, live_gateway
from tests.otlp_receiver import OtlpReceiver, otlp_receiver

VERSION = "sha256:" + "ab" * 32
SERVED = "stub-model"
STREAM = [
    {"choices": [{"index": 0, "text": "hi", "token_ids": [5], "finish_reason": None}]},
    {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}]},
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}},
]


@dataclass
class StubReplica:
    """Answers what the vLLM backend asks of a plain replica; keeps each request's headers."""

    port: int = 0
    received: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers_of(self, path: str) -> list[dict[str, str]]:
        with self.lock:
            return [headers for seen, headers in self.received if seen == path]


ANSWERS: dict[str, Any] = {
    "/health": {},
    "/v1/models": {"object": "list", "data": [{"id": SERVED, "max_model_len": 512}]},
    "/version": {"version": "stub"},
    "/tokenize": {"tokens": [1, 2, 3], "count": 3, "max_model_len": 512},
    "/detokenize": {"prompt": "abc"},
}


def _handler(stub: StubReplica) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            if length:
                self.rfile.read(length)
            with stub.lock:
                stub.received.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
            if self.path == "/v1/completions":
                events = [f"data: {json.dumps(chunk)}\n\n" for chunk in STREAM]
                body = ("".join(events) + "data: [DONE]\n\n").encode()
                kind = "text/event-stream"
            elif self.path == "/metrics":
                body, kind = b"# no speculative decoding here\n", "text/plain"
            elif self.path in ANSWERS:
                body, kind = json.dumps(ANSWERS[self.path]).encode(), "application/json"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = _answer
        do_POST = _answer

        def log_message(self, format: str, *args: Any) -> None:
            return

    return Handler


@pytest.fixture(scope="module")
def stub() -> Iterator[StubReplica]:
    replica = StubReplica()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(replica))
    replica.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield replica
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_receiver() as running:
        yield running


@pytest.fixture(scope="module")
def gateway(
    stub: StubReplica, receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveGateway]:
    root: Path = tmp_path_factory.mktemp("vllm-trace")
    with fresh_database() as (name, url):
        settings = Settings(
            backend=BackendSettings.model_validate(
                {
                    "kind": "vllm",
                    "vllm_servers": [{"url": stub.url, "model_version": VERSION}],
                    "health_interval_s": 0.5,
                }
            ),
            database_url=url,
            data_dir=root / "data",
            log_format="console",
            otlp_endpoint=receiver.endpoint,
        )
        with live_gateway(settings, name, load_configured_backend) as running:
            yield running


def traceparent(headers: dict[str, str]) -> tuple[str, str]:
    """(trace id, parent span id) of a W3C ``traceparent`` header."""
    version, trace_id, span_id, _flags = headers["traceparent"].split("-")
    assert version == "00"
    return trace_id, span_id


def test_the_generation_request_carries_the_gateways_trace(
    gateway: LiveGateway, stub: StubReplica, receiver: OtlpReceiver
) -> None:
    answer = httpx.post(
        gateway.base_url + "/v1/completions",
        json={"model": SERVED, "prompt": "hello", "max_tokens": 1},
        headers={"authorization": f"Bearer {gateway.keys['app']}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    genai = receiver.wait_for(f"text_completion {SERVED}")
    (sent,) = stub.headers_of("/v1/completions")
    # The generation is sent under the completion's GenAI span: vLLM's spans are its children.
    assert traceparent(sent) == (genai.trace_id, genai.span_id)
    # The prompt's /tokenize, the last one (the first ones probed the template at start-up).
    tokenized = stub.headers_of("/tokenize")[-1]
    assert traceparent(tokenized)[0] == genai.trace_id
