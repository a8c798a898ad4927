"""Stored content survives an outage: a completion whose direct commit fails goes to the
durable spool with its text sealed (encrypted under the subject's data key, never plaintext
on disk), and the content row is committed with the event when the store returns.

The outage tests run their own PostgreSQL (tests/pg_instance.py) on a free port,
which they stop or stall (SIGSTOP) mid-stream.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from concurrent.futures import Future
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from gateway.audit.log import AppendedEvent, AuditLog
from gateway.audit.schema import audit_events
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine
from gateway.privacy.commitments import ContentUnreadableError, text_bytes
from gateway.privacy.kek import KeyEncryptionKey
from gateway.privacy.schema import privacy_content
from gateway.privacy.store import PrivacyStore, SealedContent
from gateway.spool import EventSpool
from tests.api_harness import LiveGateway
from tests.pg_instance import PgInstance, gateway_on, running_instance
from tests.stream_reader import Stream, wait_until
from tests.tiny_models import build_pair

MODEL = "target"
CANARY = "canary-spool-8c2f-Berta-Beispiel-diagnosis"
STREAM = {
    "model": MODEL,
    "messages": [{"role": "user", "content": CANARY}],
    "max_tokens": 300,
    "temperature": 0,
    "stream": True,
    "user": "subject-spool",
}


@pytest.fixture(scope="module")
def own_pg() -> Iterator[PgInstance]:
    with running_instance() as instance:
        yield instance


@pytest.fixture(scope="module")
def gateway(own_pg: PgInstance, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    models = build_pair(tmp_path_factory.mktemp("spool-models"))
    with gateway_on(own_pg, models, tmp_path_factory, "spool", store_content=True) as live:
        yield live


def _completion(db: sa.Engine, request_event_id: str) -> list[dict[str, Any]]:
    with db.connect() as connection:
        rows = connection.execute(
            sa.select(audit_events.c.payload)
            .where(audit_events.c.kind == "completion")
            .order_by(audit_events.c.seq)
        )
        return [p for (p,) in rows if p["request_event_id"] == request_event_id]


def _plaintext_forms(text: str) -> list[str]:
    """How the text (or a long piece of it) would appear in a JSON-lines spool file."""
    encoded = json.dumps(text, ensure_ascii=False)[1:-1]
    return [text, encoded, *(encoded[i : i + 24] for i in range(0, max(len(encoded) - 24, 1), 40))]


@pytest.mark.parametrize("fault", ["stop", "stall"])
def test_a_spooled_completion_keeps_its_stored_text_sealed_on_disk(
    gateway: LiveGateway, own_pg: PgInstance, fault: str
) -> None:
    services = gateway.services
    stream = Stream(gateway.base_url, {"authorization": f"Bearer {gateway.keys['app']}"}, STREAM)
    assert stream.first_chunk.wait(60)
    (own_pg.stop if fault == "stop" else own_pg.pause)()
    try:
        assert stream.ended.wait(90)
        assert stream.done, "the stream did not end with [DONE]"
        assert services.spool.pending >= 1
        assert len(stream.text) > 40
        on_disk = "".join(
            path.read_text("utf-8", errors="replace")
            for path in services.settings.data_dir.rglob("*")
            if path.is_file()
        )
        assert '"content":{"content_id"' in on_disk  # the entry carries the sealed content
        for form in _plaintext_forms(stream.text):
            assert form not in on_disk, f"completion text in the data directory: {form!r}"
        assert CANARY not in on_disk
    finally:
        (own_pg.start if fault == "stop" else own_pg.resume)()
    wait_until(lambda: services.spool.pending == 0, 60, "the spool to drain")
    assert stream.audit_id is not None
    [completion] = _completion(services.db, stream.audit_id)
    assert completion["outcome"] == "ok"
    if fault == "stop":
        assert "spool" in completion  # committed by the spool's writer, not the direct attempt
    # The content row is there, matches the event's commitment and decrypts to what was sent.
    with services.db.connect() as connection:
        ciphertext = connection.execute(
            sa.select(privacy_content.c.ciphertext).where(
                privacy_content.c.content_id == completion["content"]["content_id"]
            )
        ).scalar_one()
    assert hashlib.sha256(ciphertext).hexdigest() == completion["content"]["ciphertext_sha256"]
    stored = services.privacy.read_content(completion["content"])
    assert "".join(choice["text"] for choice in stored["choices"]) == stream.text
    key = services.privacy.existing_key(completion["commitment_key"]["key_ref"])
    assert key is not None
    assert key.commitments.confirms(
        text_bytes(stream.text), completion["completion_commitments"][0]
    )
    report = services.audit.verify()
    assert report.ok, report.reason


def _failed_attempt() -> Future[AppendedEvent]:
    attempt: Future[AppendedEvent] = Future()
    attempt.set_exception(OSError("the store went away"))
    return attempt


def test_a_spool_left_by_a_crash_commits_its_sealed_content_once(
    pg_url: str, tmp_path: Path
) -> None:
    """The sealed content is read back from the file by the next process; content whose key
    was erased meanwhile is discarded (never stored), and the event says so."""
    db = make_db_engine(pg_url)
    audit = AuditLog(db, CheckpointSigner.load_or_create(tmp_path / "signing.pem"))
    store = PrivacyStore(db, KeyEncryptionKey(b"s" * 32), audit)
    kept, erased = store.subject_ref("user:kept"), store.subject_ref("user:erased")
    first = EventSpool(tmp_path, audit, db, retry_s=0.1)
    sealed = {}
    for subject in (kept, erased):
        key = store.data_key(subject)
        sealed[subject] = SealedContent.seal(key, "completion", {"text": f"{CANARY}-{subject}"})
        payload = {"request_event_id": f"request-{subject}", "outcome": "ok"}
        first.keep(
            "completion", "key_a", payload, _failed_attempt(), datetime.now(UTC), sealed[subject]
        )
    assert CANARY not in first.path.read_text("utf-8")
    store.erase_subject(erased, "tests")

    second = EventSpool(tmp_path, audit, db, retry_s=0.1)
    assert second.pending == 2
    second.drain()
    events = {e["request_event_id"]: e for e in _completion_all(db)}
    kept_event, erased_event = events[f"request-{kept}"], events[f"request-{erased}"]
    assert kept_event["content"] == sealed[kept].commitment
    assert store.read_content(kept_event["content"]) == {"text": f"{CANARY}-{kept}"}
    assert erased_event["content"].get("discarded"), erased_event
    with pytest.raises(ContentUnreadableError, match="erased"):
        store.read_content(erased_event["content"])
    with db.connect() as connection:
        rows = connection.execute(sa.select(privacy_content.c.key_ref)).scalars().all()
    assert rows == [sealed[kept].key_ref]
    assert EventSpool(tmp_path, audit, db, retry_s=0.1).pending == 0
    assert audit.verify().ok
    db.dispose()


def _completion_all(db: sa.Engine) -> list[dict[str, Any]]:
    with db.connect() as connection:
        query = sa.select(audit_events.c.payload).where(audit_events.c.kind == "completion")
        return [p for (p,) in connection.execute(query.order_by(audit_events.c.seq))]


def test_a_commit_whose_answer_was_lost_is_not_committed_twice(pg_url: str, tmp_path: Path) -> None:
    """The direct attempt committed, but its answer never came (the connection dropped after
    COMMIT): the spooled copy finds its content row, so the event stays single and the spool
    does not stick on the duplicate."""
    db = make_db_engine(pg_url)
    audit = AuditLog(db, CheckpointSigner.load_or_create(tmp_path / "signing.pem"))
    store = PrivacyStore(db, KeyEncryptionKey(b"s" * 32), audit)
    sealed = SealedContent.seal(store.data_key(store.subject_ref("user:lost")), "completion", [1])
    spool = EventSpool(tmp_path, audit, db, retry_s=0.1)
    payload = {"request_event_id": "request-lost", "outcome": "ok"}
    spool.commit("completion", "key_a", payload, sealed)
    spool.keep("completion", "key_a", payload, _failed_attempt(), datetime.now(UTC), sealed)
    spool.drain()
    assert spool.pending == 0
    assert [e["request_event_id"] for e in _completion_all(db)] == ["request-lost"]
    db.dispose()
