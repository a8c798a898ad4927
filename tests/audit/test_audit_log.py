"""The audit store on PostgreSQL and on SQLite: appends, chain, checkpoints, export, refusal of
changes, concurrent writers."""

from __future__ import annotations

import base64
import json
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import sql
from sqlalchemy.exc import DBAPIError

from gateway.audit.canonical import GENESIS_HASH
from gateway.audit.log import AuditLog, AuditUnavailableError
from gateway.audit.mac import EventMac
from gateway.audit.note import verify_checkpoint
from gateway.audit.signing import CheckpointSigner
from gateway.audit.verify import verify_export
from gateway.db import make_db_engine

MAC = EventMac(b"k" * 32)


def events_of(lines: list[str]) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return [r for r in records if r["record"] == "event"]


def closing_note(lines: list[str]) -> str:
    note: str = json.loads(lines[-1])["note"]
    return note


@pytest.fixture
def signer(tmp_path: Path) -> CheckpointSigner:
    return CheckpointSigner.load_or_create(tmp_path / "keys" / "signing.pem")


@pytest.fixture
def log(db: sa.Engine, signer: CheckpointSigner, tmp_path: Path) -> AuditLog:
    return AuditLog(db, signer, MAC, tmp_path / "state.json")


def test_append_chains_events_and_export_verifies(log: AuditLog, signer: CheckpointSigner) -> None:
    first = log.append("startup", None, {"config": {"port": 8000}, "models": ["t", "d"]})
    second = log.append("request", "key_1", {"prompt_sha256": "ab" * 32, "seed": 7})
    assert (first.seq, second.seq) == (1, 2)
    lines = list(log.export(None, None, "jsonl", actor="key_auditor"))
    events = events_of(lines)
    assert [e["seq"] for e in events] == [1, 2]
    assert events[0]["prev_hash"] == GENESIS_HASH
    assert events[1]["prev_hash"] == first.event_hash == events[0]["event_hash"]
    assert events[1]["event_id"] == second.event_id
    assert events[1]["payload"] == {"prompt_sha256": "ab" * 32, "seed": 7}
    assert events[1]["mac"] == MAC.mac(
        json.dumps(
            {
                k: events[1][k]
                for k in ("actor", "created_at", "event_id", "kind", "payload", "prev_hash", "seq")
            },
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode()
    )
    # The export was itself recorded, after the exported range, and the checkpoint after it.
    checkpoint = verify_checkpoint(closing_note(lines), signer.public_key, signer.origin)
    assert checkpoint.size == 3
    report = verify_export(lines, signer.public_key_pem(), mac=MAC)
    assert (report.ok, report.events_checked, report.first_bad_seq) == (True, 2, None)
    assert log.head()[0] == 4


def test_export_of_a_later_range_verifies_and_csv_matches(
    log: AuditLog, signer: CheckpointSigner
) -> None:
    for i in range(3):
        log.append("request", "early", {"i": i})
    boundary = datetime.now(UTC)
    for i in range(4):
        log.append("request", "late", {"i": i})
    until = datetime.now(UTC)
    log.append("request", "after", {"i": 99})
    jsonl = list(log.export(boundary, until, "jsonl"))
    csv_lines = list(log.export(boundary, until, "csv"))
    assert [e["seq"] for e in events_of(jsonl)] == [4, 5, 6, 7]
    assert len(csv_lines) == 1 + 1 + 4 + 1
    for lines in (jsonl, csv_lines):
        report = verify_export(lines, signer.public_key_pem(), mac=MAC)
        assert (report.ok, report.events_checked) == (True, 4)


def test_consecutive_exports_chain_onto_each_other(log: AuditLog, signer: CheckpointSigner) -> None:
    log.append("request", "a", {"i": 1})
    boundary = datetime.now(UTC)
    log.append("request", "a", {"i": 2})
    earlier = list(log.export(None, boundary, "jsonl"))
    later = list(log.export(boundary, None, "jsonl"))
    # The first export's own `export` and `checkpoint` events fall in the second range.
    kinds = [e["kind"] for e in events_of(later)]
    assert kinds == ["request", "export", "checkpoint"]
    # The earlier export's checkpoint is a trusted checkpoint for the later one.
    report = verify_export(
        later, signer.public_key_pem(), mac=MAC, trusted_checkpoint=closing_note(earlier)
    )
    assert report.ok, report.reason


def test_empty_range_exports_a_signed_empty_checkpoint(
    log: AuditLog, signer: CheckpointSigner
) -> None:
    log.append("request", "a", {})
    lines = list(log.export(datetime.now(UTC) + timedelta(days=1), None, "jsonl"))
    assert len(lines) == 2
    assert events_of(lines) == []
    assert verify_export(lines, signer.public_key_pem()).ok


def test_checkpoint_is_signed_and_recorded(log: AuditLog, signer: CheckpointSigner) -> None:
    appended = log.append("request", "a", {"n": 1})
    checkpoint = log.checkpoint()
    signed = verify_checkpoint(checkpoint["note"], signer.public_key, signer.origin)
    assert (signed.size, signed.root_b64) == (1, checkpoint["root"])
    assert signed.root == appended.leaf_hash  # a tree of one leaf
    assert log.head()[0] == 2
    recorded = events_of(list(log.export(None, None, "jsonl")))[1]
    assert (recorded["kind"], recorded["payload"]) == ("checkpoint", checkpoint)
    assert log.verify().ok


def test_server_side_verify_covers_a_range(log: AuditLog) -> None:
    for i in range(5):
        log.append("request", "a", {"i": i})
    report = log.verify(datetime.now(UTC) - timedelta(hours=1), None)
    assert (report.ok, report.events_checked) == (True, 5)


def test_database_refuses_update_and_delete(db: sa.Engine, log: AuditLog) -> None:
    log.append("request", "a", {"i": 1})
    for statement in (
        "UPDATE audit_events SET actor = 'mallory' WHERE seq = 1",
        "DELETE FROM audit_events WHERE seq = 1",
    ):
        with pytest.raises(DBAPIError, match="append-only"), db.begin() as connection:
            connection.exec_driver_sql(statement)
    assert log.verify().ok


def test_concurrent_writers_leave_one_gapless_chain(
    log: AuditLog, signer: CheckpointSigner
) -> None:
    writers, per_writer = 32, 15
    barrier = threading.Barrier(writers)
    errors: list[BaseException] = []

    def write(index: int) -> None:
        barrier.wait()
        try:
            for i in range(per_writer):
                log.append("request", f"writer-{index}", {"i": i})
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    lines = list(log.export(None, None, "jsonl"))
    seqs = [e["seq"] for e in events_of(lines)]
    assert seqs == list(range(1, writers * per_writer + 1))
    report = verify_export(lines, signer.public_key_pem(), mac=MAC)
    assert (report.ok, report.events_checked) == (True, writers * per_writer)


def test_two_audit_logs_on_one_database_share_the_chain(
    db_url: str, signer: CheckpointSigner
) -> None:
    """Two processes' worth of writers (separate engines) interleave into one chain."""
    engines = [make_db_engine(db_url) for _ in range(2)]
    logs = [AuditLog(engine, signer, MAC) for engine in engines]
    threads = [
        threading.Thread(target=lambda lg=lg: [lg.append("request", None, {}) for _ in range(20)])
        for lg in logs
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report = logs[0].verify()
    assert (report.ok, report.events_checked) == (True, 40)
    for engine in engines:
        engine.dispose()


def test_invalid_events_are_refused_before_writing(log: AuditLog) -> None:
    with pytest.raises(ValueError, match="kind"):
        log.append("Bad Kind", None, {})
    with pytest.raises(ValueError, match="canonical JSON"):
        log.append("request", None, {"x": float("nan")})
    with pytest.raises(ValueError, match="actor"):
        log.append("request", "line\nbreak", {})
    assert log.head() == (0, GENESIS_HASH)


def test_unreachable_database_raises_audit_unavailable(signer: CheckpointSigner) -> None:
    dead = make_db_engine("postgresql://postgres@127.0.0.1:1/nothing")
    log = AuditLog(dead, signer)
    with pytest.raises(AuditUnavailableError):
        log.append("request", None, {})
    assert log.ping() is False
    with pytest.raises(AuditUnavailableError):
        log.export(None, None, "jsonl")


def test_signing_key_is_created_once_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "data" / "signing.pem"
    created = CheckpointSigner.load_or_create(path)
    assert path.stat().st_mode & 0o777 == 0o600
    loaded = CheckpointSigner.load_or_create(path)
    assert loaded.public_key_pem() == created.public_key_pem()
    assert created.public_key_pem().startswith(b"-----BEGIN PUBLIC KEY-----")


def test_appends_fail_closed_while_postgres_refuses_writes_and_resume(
    pg_url: str, signer: CheckpointSigner
) -> None:
    db = make_db_engine(pg_url)
    log = AuditLog(db, signer, MAC)
    log.append("request", "a", {"n": 1})
    name = pg_url.rsplit("/", 1)[1]

    def set_read_only(value: str) -> None:
        with psycopg.connect(pg_url.rsplit("/", 1)[0] + "/test", autocommit=True) as admin:
            admin.execute(
                sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = " + value).format(
                    sql.Identifier(name)
                )
            )
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (name,),
            )

    set_read_only("on")
    with pytest.raises(AuditUnavailableError, match="read-only"):
        log.append("request", "a", {"n": 2})
    set_read_only("off")
    assert log.append("request", "a", {"n": 3}).seq == 2
    report = log.verify()
    assert (report.ok, report.events_checked) == (True, 2)
    db.dispose()


def test_export_after_the_trusted_checkpoint_needs_and_checks_a_consistency_proof(
    log: AuditLog, signer: CheckpointSigner
) -> None:
    for i in range(5):
        log.append("request", "a", {"i": i})
    trusted = log.checkpoint()["note"]  # size 5
    for i in range(6):
        log.append("request", "a", {"i": i})
    boundary = datetime.now(UTC)
    log.append("request", "b", {"late": True})  # the export starts after the trusted size
    pem = signer.public_key_pem()
    with_proof = list(log.export(boundary, None, "jsonl", consistency_from=5))
    report = verify_export(with_proof, pem, mac=MAC, trusted_checkpoint=trusted)
    assert report.ok, report.reason
    without = list(log.export(boundary, None, "jsonl"))
    report = verify_export(without, pem, mac=MAC, trusted_checkpoint=trusted)
    assert not report.ok and "consistency_from=5" in report.reason
    tree = json.loads(with_proof[0])
    assert tree["consistency"]
    tree["consistency"][0] = base64.b64encode(bytes(32)).decode()  # a wrong hash
    corrupted = [json.dumps(tree, sort_keys=True, separators=(",", ":")) + "\n", *with_proof[1:]]
    report = verify_export(corrupted, pem, mac=MAC, trusted_checkpoint=trusted)
    assert not report.ok and "does not extend the trusted checkpoint" in report.reason
