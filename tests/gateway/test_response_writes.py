"""A response leaves the gateway in as few writes as it can: a small answer's status line,
headers and body in one (``gateway.server``). Each write is a segment on the wire and can be a
wake-up of the client; uvicorn on its own writes the head and the body apart."""

from __future__ import annotations

import asyncio.selector_events
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.api_harness import LiveGateway, tiny_pair_gateway

MODEL = "target"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    with tiny_pair_gateway(tmp_path_factory.mktemp("writes")) as live:
        yield live


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every write of the server's sockets (the test's client is not asyncio)."""
    written: list[bytes] = []
    transport = asyncio.selector_events._SelectorSocketTransport
    write = transport.write

    def recording(self: Any, data: Any) -> None:
        written.append(bytes(data))
        write(self, data)

    monkeypatch.setattr(transport, "write", recording)
    return written


def test_a_small_answer_is_one_write(gateway: LiveGateway, writes: list[bytes]) -> None:
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    with httpx.Client(base_url=gateway.base_url, headers=headers, timeout=60) as client:
        client.get("/healthz")  # the connection is open
        for method, path, body in (
            ("GET", "/healthz", None),
            ("POST", "/v1/chat/completions", CHAT),
            ("POST", "/v1/chat/completions", {**CHAT, "model": "no-such-model"}),
        ):
            writes.clear()
            response = client.request(method, path, json=body)
            assert response.status_code in (200, 404), response.text
            assert len(writes) == 1, writes
            assert writes[0].startswith(b"HTTP/1.1 ") and writes[0].endswith(response.content)


def test_a_stream_arrives_whole(gateway: LiveGateway, writes: list[bytes]) -> None:
    """Held writes of a stream go out at the loop's next turn: every chunk, in order."""
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    with httpx.Client(base_url=gateway.base_url, headers=headers, timeout=60) as client:
        writes.clear()
        with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) >= 3
    assert b"".join(writes).startswith(b"HTTP/1.1 200")
