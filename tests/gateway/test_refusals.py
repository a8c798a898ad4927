"""Requests refused at admission are audited as counted `refused` summaries: a flood of 429s
becomes one event per window (the store is never asked per refusal), with exact counts per
key and reason, and no text."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from gateway.audit.log import AuditLog
from gateway.audit.schema import audit_events
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine
from gateway.refusals import MAX_KEYS_LISTED, RefusalLog
from gateway.spool import EventSpool


def _refused(db: sa.Engine) -> list[dict[str, Any]]:
    query = sa.select(audit_events.c.payload).where(audit_events.c.kind == "refused")
    with db.connect() as connection:
        return list(connection.scalars(query.order_by(audit_events.c.seq)))


def test_a_flood_of_refusals_is_one_counted_event_per_window(pg_url: str, tmp_path: Path) -> None:
    db = make_db_engine(pg_url)
    log = AuditLog(db, CheckpointSigner.load_or_create(tmp_path / "s.pem"))
    spool = EventSpool(tmp_path, log, db, 0.05)
    spool.start()
    refusals = RefusalLog(spool, model="m", instance_id="gw-0", window_s=3600)
    started = time.perf_counter()
    for i in range(20_000):
        refusals.count("key_a" if i % 4 else "key_b", "queue_full")
    for i in range(MAX_KEYS_LISTED + 10):
        refusals.count(f"key_{i:04d}", "queue_full")
    counting_s = time.perf_counter() - started
    assert _refused(db) == []  # nothing reaches the store per refusal
    assert refusals.flush() == 20_000 + MAX_KEYS_LISTED + 10
    assert refusals.flush() == 0  # an empty window writes nothing
    refusals.close()
    spool.close(30)
    (event,) = _refused(db)
    by_key = {r["key_id"]: r["count"] for r in event["refusals"]}
    assert by_key["key_a"] == 15_000 and by_key["key_b"] == 5_000
    assert len(event["refusals"]) == MAX_KEYS_LISTED
    listed = sum(by_key.values())
    assert listed + event["unlisted_refusals"] == event["total"] == 20_000 + MAX_KEYS_LISTED + 10
    assert event["unlisted_keys"] == event["unlisted_refusals"] == 12
    assert {r["reason"] for r in event["refusals"]} == {"queue_full"}
    assert (event["model"], event["instance_id"]) == ("m", "gw-0")
    assert event["window_start"] <= event["window_end"]
    assert log.verify().ok
    print(f"counting one refusal: {counting_s / 20_266 * 1e6:.2f} µs")
    db.dispose()
