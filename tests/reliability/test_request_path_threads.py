"""The request path takes no thread from anyio's shared pool.

That pool (40 threads) is what Starlette and FastAPI use for sync dependencies and sync
routes; a hop through it costs a thread wake-up and a GIL hand-off each way, and under load it
queues behind whatever else holds its threads. Completions, streamed or not, and the model
list must be served with the gateway's own hand-offs only (``gateway.offload``, the engine's
wake-up of the loop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anyio.to_thread
import httpx
import pytest

from tests.api_harness import LiveGateway, tiny_pair_gateway

MODEL = "target"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    with tiny_pair_gateway(tmp_path_factory.mktemp("threads")) as live:
        yield live


def test_completions_use_no_thread_of_anyios_pool(
    gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    url = gateway.base_url
    # First calls: the key is looked up (on the gateway's database pool) and cached.
    assert httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
    borrowed: list[str] = []
    run_sync = anyio.to_thread.run_sync

    async def counting(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        borrowed.append(getattr(func, "__qualname__", repr(func)))
        return await run_sync(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counting)
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        for body in (CHAT, {**CHAT, "stream": True}):
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
        completion = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 6}
        assert client.post("/v1/completions", json=completion).status_code == 200
        assert client.get("/v1/models").status_code == 200
    assert borrowed == []


def test_a_completions_audit_appends_take_no_database_pool_thread(
    gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once this gateway knows the audit head (after its own appends), a completion's
    `request` and `completion` events are appended from the event loop
    (``gateway.audit.loop_append``), streamed or not: no hand-off to the database pool."""
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    url = gateway.base_url
    assert httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
    offload = gateway.services.offload
    submitted: list[str] = []
    submit_db = offload.submit_db

    def counting(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        submitted.append(getattr(fn, "__qualname__", repr(fn)))
        return submit_db(fn, *args, **kwargs)

    monkeypatch.setattr(offload, "submit_db", counting)
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        for body in (CHAT, {**CHAT, "stream": True}):
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
    audit_calls = [name for name in submitted if "renew" not in name and "expired" not in name]
    assert audit_calls == []
