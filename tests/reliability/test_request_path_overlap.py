"""What the gateway does while an audit commit is in flight, and what it holds back.

The engine may begin on a request before its `request` event is committed
(``start_before_request_commit``), but no byte of the completion may leave the gateway until
the commit lands: when it does not (a stalled PostgreSQL of the test's own, SIGSTOP), the
client gets 503 `audit_unavailable` and nothing else, the engine's work is cancelled, and no
completion is recorded as served. A non-streaming answer is rendered while its `completion`
event commits, and sent only if the event was committed or spooled.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from engine.api.types import GenerationRequest
from engine.serving.service import RequestHandle
from gateway.audit.log import AppendedEvent, AuditUnavailableError
from gateway.audit.schema import audit_events
from tests.api_harness import LiveGateway
from tests.pg_instance import PgInstance, gateway_on, running_instance
from tests.tiny_models import build_pair

MODEL = "target"
AUDIT_TIMEOUT_S = 1.5
# The 503 comes after the audit bound; the rest is slack for a busy 2-core machine.
ANSWER_BOUND_S = AUDIT_TIMEOUT_S + 3.0
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 400}
GREEDY = {**CHAT, "max_tokens": 12, "temperature": 0, "speculative": False}


@pytest.fixture(scope="module")
def own_pg() -> Iterator[PgInstance]:
    with running_instance() as instance:
        yield instance


@pytest.fixture(scope="module")
def gateway(own_pg: PgInstance, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    models = build_pair(tmp_path_factory.mktemp("overlap-models"))
    with gateway_on(
        own_pg,
        models,
        tmp_path_factory,
        "overlap",
        audit_timeout_s=AUDIT_TIMEOUT_S,
        start_before_request_commit=True,
    ) as live:
        yield live


class SubmittedHandles:
    """The engine's handles for the requests the gateway submits while installed."""

    def __init__(self, gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch) -> None:
        self.handles: list[RequestHandle] = []
        engine = gateway.engine
        real_submit = engine.submit

        def spy(request: GenerationRequest) -> RequestHandle:
            handle = real_submit(request)
            self.handles.append(handle)
            return handle

        monkeypatch.setattr(engine, "submit", spy)


def _headers(gateway: LiveGateway, role: str = "app") -> dict[str, str]:
    return {"authorization": f"Bearer {gateway.keys[role]}"}


def _events(gateway: LiveGateway, kind: str) -> list[sa.Row[Any]]:
    with gateway.services.db.connect() as connection:
        query = sa.select(audit_events).where(audit_events.c.kind == kind)
        return list(connection.execute(query.order_by(audit_events.c.seq)))


def _wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_with_the_overlap_a_healthy_store_serves_the_same_tokens_after_the_request_event(
    gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    submitted = SubmittedHandles(gateway, monkeypatch)
    answers = []
    for stream in (False, True):
        response = httpx.post(
            gateway.base_url + "/v1/chat/completions",
            json={**GREEDY, "stream": stream},
            headers=_headers(gateway),
            timeout=60,
        )
        assert response.status_code == 200, response.text
        answers.append(response)
    direct = gateway.engine.generate(submitted.handles[0].request)
    assert answers[0].json()["choices"][0]["message"]["content"] == direct.text
    chunks = [json.loads(line[6:]) for line in answers[1].text.splitlines() if line[6:7] == "{"]
    streamed = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    assert streamed == direct.text
    requests = {r.event_id: r.seq for r in _events(gateway, "request")}
    for answer in answers:
        audit_id = answer.headers["x-specgate-audit-id"]
        (completion,) = [
            c for c in _events(gateway, "completion") if c.payload["request_event_id"] == audit_id
        ]
        assert completion.payload["outcome"] == "ok"
        assert requests[audit_id] < completion.seq


@pytest.mark.parametrize("stream", [False, True])
def test_a_stalled_request_commit_serves_no_byte_cancels_the_engine_and_records_nothing_served(
    gateway: LiveGateway, own_pg: PgInstance, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    services = gateway.services
    known = {r.event_id for r in _events(gateway, "request")}
    submitted = SubmittedHandles(gateway, monkeypatch)
    received: list[bytes] = []
    answer: dict[str, Any] = {}

    def ask() -> None:
        started = time.monotonic()
        with httpx.stream(
            "POST",
            gateway.base_url + "/v1/chat/completions",
            json={**CHAT, "stream": stream},
            headers=_headers(gateway),
            timeout=60,
        ) as response:
            answer["status"] = response.status_code
            answer["content_type"] = response.headers.get("content-type")
            for piece in response.iter_raw():
                received.append(piece)
        answer["seconds"] = time.monotonic() - started

    # The key check must not need the store that is about to stall: a fresh lookup just
    # before the pause keeps the key in the cache for key_cache_ttl_s (else, after a slow
    # earlier test, authentication itself waits on the paused store and the engine never
    # sees the request). An entry still cached is dropped first: it may be about to expire.
    cached = services.key_cache.get(gateway.keys["app"])
    if cached is not None:
        services.key_cache.forget(cached.key_id)
    warm = httpx.get(gateway.base_url + "/v1/models", headers=_headers(gateway), timeout=30)
    assert warm.status_code == 200, warm.text
    own_pg.pause()
    try:
        asker = threading.Thread(target=ask)
        asker.start()
        # The overlap: the engine has the request while its `request` event cannot commit.
        _wait(lambda: len(submitted.handles) == 1, 30, "the engine to be given the request")
        asker.join(60)
        assert answer["status"] == 503, answer
        assert answer["seconds"] < ANSWER_BOUND_S, answer
        body = json.loads(b"".join(received))
        assert body["error"]["code"] == "audit_unavailable", body
        assert answer["content_type"] == "application/json"
        assert b"data:" not in b"".join(received)
        (handle,) = submitted.handles
        assert handle.cancelled
        _wait(lambda: gateway.engine.queue_depth == 0, 30, "the engine to drop the request")
    finally:
        own_pg.resume()
    # The `request` event commits late, once the store answers; it is then answered with a
    # `not_served` completion, and nothing records it as served.
    _wait(lambda: services.spool.pending == 0, 60, "the spool to drain")
    late = [r for r in _events(gateway, "request") if r.event_id not in known]

    def answered() -> list[sa.Row[Any]]:
        ids = {r.event_id for r in late}
        return [c for c in _events(gateway, "completion") if c.payload["request_event_id"] in ids]

    _wait(lambda: len(answered()) == len(late), 30, "the late request's completion")
    assert [c.payload["outcome"] for c in answered()] == ["not_served"] * len(late)
    report = httpx.get(
        gateway.base_url + "/v1/audit/verify", headers=_headers(gateway, "auditor"), timeout=60
    ).json()
    assert report["ok"] is True, report


def test_an_answer_rendered_during_the_completion_commit_is_not_sent_when_it_fails(
    gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = gateway.services

    submit = services.appender.submit

    def refused(kind: str, actor: str | None, payload: dict[str, Any]) -> Future[AppendedEvent]:
        if kind != "completion":
            return submit(kind, actor, payload)
        failed: Future[AppendedEvent] = Future()
        failed.set_exception(AuditUnavailableError("audit store unavailable: refused by the test"))
        return failed

    def unwritable(*_: Any) -> Any:
        raise OSError("spool refused by the test")

    monkeypatch.setattr(services.appender, "submit", refused)  # the completion's direct commit
    monkeypatch.setattr(services.spool, "keep", unwritable)
    response = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        json=GREEDY,
        headers=_headers(gateway),
        timeout=60,
    )
    assert response.status_code == 503, response.text
    assert set(response.json()) == {"error"}
    assert response.json()["error"]["code"] == "completion_not_recorded"
