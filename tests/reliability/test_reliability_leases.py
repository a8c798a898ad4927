"""Instance leases: the unanswered requests of a gateway that never comes back are marked
`interrupted` by a live one, exactly once, however many gateways race to do it."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from gateway.audit.log import AuditLog
from gateway.audit.schema import audit_events
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine
from gateway.leases import Leases, instance_leases
from gateway.settings import Settings
from tests.api_harness import fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_pair

EXPIRED_TTL_S = 0.01


def _log(db: sa.Engine, tmp_path: Path) -> AuditLog:
    return AuditLog(db, CheckpointSigner.load_or_create(tmp_path / "signing.pem"))


def _vanished_instance(log: AuditLog, db: sa.Engine, name: str, requests: int) -> set[str]:
    """An instance that started, took a lease, received ``requests`` requests (answering
    the first one) and vanished; then its lease ran out (set to its renewal time: the lease
    cannot expire while this sets it up). Returns the unanswered event ids."""
    Leases(log, db, name, 3600.0).take()
    log.append("startup", "specgate", {"instance_id": name})
    ids = [
        log.append("request", "key_a", {"instance_id": name, "request_id": f"{name}-{i}"}).event_id
        for i in range(requests)
    ]
    log.append("completion", "key_a", {"request_event_id": ids[0], "outcome": "ok"})
    with db.begin() as connection:
        connection.execute(
            sa.update(instance_leases)
            .where(instance_leases.c.instance_id == name)
            .values(expires_at=instance_leases.c.renewed_at)
        )
    return set(ids[1:])


def _interrupted(db: sa.Engine) -> Counter[str]:
    query = sa.select(audit_events.c.payload).where(audit_events.c.kind == "interrupted")
    with db.connect() as connection:
        return Counter(p["request_event_id"] for p in connection.scalars(query))


def _leases(db: sa.Engine) -> dict[str, Any]:
    with db.connect() as connection:
        rows = connection.execute(sa.select(instance_leases))
        return {row.instance_id: row.expires_at for row in rows}


def _race(*calls: Callable[[], object]) -> list[BaseException]:
    """Run ``calls`` on threads released together; returns what they raised."""
    barrier = threading.Barrier(len(calls))
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        barrier.wait()
        try:
            call()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return errors


def test_two_gateways_racing_mark_each_request_of_a_vanished_instance_once(
    pg_url: str, tmp_path: Path
) -> None:
    """Two gateways (each its own connection pool and audit log object) run their expiry
    pass at the same moment, round after round: every unanswered request gets exactly one
    `interrupted` event, answered ones none, and the dead leases are gone."""
    dbs = [make_db_engine(pg_url) for _ in range(3)]
    setup, first, second = (_log(db, tmp_path) for db in dbs)
    gateways = [
        Leases(first, dbs[1], "gateway-a", 30.0),
        Leases(second, dbs[2], "gateway-b", 30.0),
    ]
    for gateway in gateways:
        gateway.take()
    expected: set[str] = set()
    for round_ in range(8):
        expected |= _vanished_instance(setup, dbs[0], f"vanished-{round_}", 6)
        assert _race(*(gateway.mark_expired for gateway in gateways)) == []
    marked = _interrupted(dbs[0])
    assert set(marked) == expected
    assert set(marked.values()) == {1}, marked
    assert set(_leases(dbs[0])) == {"gateway-a", "gateway-b"}
    report = setup.verify()
    assert report.ok, report
    for db in dbs:
        db.dispose()


def test_a_restart_under_the_same_id_racing_a_takeover_marks_once(
    pg_url: str, tmp_path: Path
) -> None:
    """The vanished instance comes back (same id) just as another gateway takes its expired
    lease over: each request is still marked once, and the restarted one holds a lease."""
    dbs = [make_db_engine(pg_url) for _ in range(3)]
    setup, returning, other = (_log(db, tmp_path) for db in dbs)
    expected: set[str] = set()
    for round_ in range(6):
        name = f"replica-{round_}"
        expected |= _vanished_instance(setup, dbs[0], name, 5)
        back = Leases(returning, dbs[1], name, 30.0)
        watcher = Leases(other, dbs[2], "watcher", 30.0)
        assert _race(back.take, watcher.mark_expired) == []
        assert name in _leases(dbs[0])
    marked = _interrupted(dbs[0])
    assert set(marked) == expected
    assert set(marked.values()) == {1}, marked
    for db in dbs:
        db.dispose()


def test_leases_work_on_sqlite(tmp_path: Path) -> None:
    from gateway.db import upgrade_database

    url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade_database(url)
    db = make_db_engine(url)
    log = _log(db, tmp_path)
    expected = _vanished_instance(log, db, "laptop-old", 3)
    live = Leases(log, db, "laptop", 30.0)
    live.take()
    assert live.mark_expired() == {"laptop-old": len(expected)}
    assert live.mark_expired() == {}
    assert set(_interrupted(db)) == expected
    db.dispose()


def test_a_lease_taken_for_expired_is_taken_anew_on_renewal(pg_url: str, tmp_path: Path) -> None:
    db = make_db_engine(pg_url)
    log = _log(db, tmp_path)
    slow = Leases(log, db, "slow", EXPIRED_TTL_S)
    slow.take()
    time.sleep(EXPIRED_TTL_S * 5)
    Leases(log, db, "other", 30.0).mark_expired()
    assert "slow" not in _leases(db)
    slow.renew()
    assert "slow" in _leases(db)
    db.dispose()


@pytest.fixture
def models(tmp_path: Path) -> tuple[Path, Path]:
    return build_pair(tmp_path / "models")


def test_a_live_gateway_marks_a_vanished_instance_without_restarting(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """A gateway renews its own lease, marks a vanished instance's requests within a few
    renewals of its lease expiring (no restart of anything), leaves its own requests alone,
    and gives its lease up at a clean shutdown."""
    with fresh_database() as (name, url):
        settings: Settings = gateway_settings(
            models, tmp_path / "data", url, lease_ttl_s=1.0, lease_renew_s=0.2
        )
        db = make_db_engine(url)
        with live_gateway(settings, name) as live:
            own = live.services.instance_id
            first_expiry = _leases(db)[own]
            expected = _vanished_instance(live.services.audit, db, "crashed-replica", 4)
            deadline = time.monotonic() + 10
            while set(_interrupted(db)) != expected and time.monotonic() < deadline:
                time.sleep(0.1)
            assert set(_interrupted(db)) == expected
            assert _leases(db)[own] > first_expiry
            assert "crashed-replica" not in _leases(db)
            with db.connect() as connection:
                payloads = connection.scalars(
                    sa.select(audit_events.c.payload).where(audit_events.c.kind == "interrupted")
                )
                assert {(p["instance_id"], p["marked_by"]) for p in payloads} == {
                    ("crashed-replica", own)
                }
        assert own not in _leases(db)
        db.dispose()
