"""Tampering with the PostgreSQL audit table, and with exports, is caught by
``specgate audit verify``, which names the first bad event and exits non-zero."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError
from typer.testing import CliRunner

from gateway.audit.canonical import event_hash
from gateway.audit.log import AuditLog
from gateway.audit.records import EventRecord, ExportFormat, encode_checkpoint, encode_event
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine
from tests.audit_helpers import admin_cli

EVENTS = 10


@pytest.fixture
def db(pg_url: str) -> Iterator[sa.Engine]:
    engine = make_db_engine(pg_url)
    yield engine
    engine.dispose()


@pytest.fixture
def signer(tmp_path: Path) -> CheckpointSigner:
    return CheckpointSigner.load_or_create(tmp_path / "signing.pem")


@pytest.fixture
def log(db: sa.Engine, signer: CheckpointSigner) -> AuditLog:
    audit = AuditLog(db, signer)
    for i in range(EVENTS):
        audit.append("request", f"key_{i % 3}", {"i": i, "prompt_sha256": f"{i:064x}"})
    return audit


def _tamper(db: sa.Engine, *statements: str) -> None:
    """What a superuser can do: switch the append-only triggers off, change rows."""
    with db.begin() as connection:
        connection.exec_driver_sql("ALTER TABLE audit_events DISABLE TRIGGER ALL")
        for statement in statements:
            connection.exec_driver_sql(statement)
        connection.exec_driver_sql("ALTER TABLE audit_events ENABLE TRIGGER ALL")


def _verify_cli(
    tmp_path: Path, lines: list[str], public_pem: bytes, suffix: str = "jsonl"
) -> tuple[int, str]:
    export = tmp_path / f"export.{suffix}"
    export.write_text("".join(lines), encoding="utf-8")
    pem = tmp_path / "pub.pem"
    pem.write_bytes(public_pem)
    result = CliRunner().invoke(
        admin_cli(), ["audit", "verify", str(export), "--public-key", str(pem)]
    )
    return result.exit_code, result.output


def _export(log: AuditLog) -> list[str]:
    return list(log.export(None, None, "jsonl", actor="auditor"))


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_untouched_log_verifies(
    tmp_path: Path, log: AuditLog, signer: CheckpointSigner, fmt: ExportFormat
) -> None:
    lines = list(log.export(None, None, fmt, actor="auditor"))
    code, output = _verify_cli(tmp_path, lines, signer.public_key_pem(), fmt)
    assert code == 0
    assert f"OK: {EVENTS} events verified" in output


def test_updated_row_is_named(
    tmp_path: Path, db: sa.Engine, log: AuditLog, signer: CheckpointSigner
) -> None:
    _tamper(db, "UPDATE audit_events SET actor = 'someone_else' WHERE seq = 4")
    code, output = _verify_cli(tmp_path, _export(log), signer.public_key_pem())
    assert code == 1
    assert "FAILED at event 4" in output
    assert "event 4 was altered" in output


def test_deleted_row_is_named(
    tmp_path: Path, db: sa.Engine, log: AuditLog, signer: CheckpointSigner
) -> None:
    _tamper(db, "DELETE FROM audit_events WHERE seq = 6")
    code, output = _verify_cli(tmp_path, _export(log), signer.public_key_pem())
    assert code == 1
    assert "FAILED at event 6" in output
    assert "expected event 6 after event 5, found event 7" in output


def test_swapped_rows_are_named(
    tmp_path: Path, db: sa.Engine, log: AuditLog, signer: CheckpointSigner
) -> None:
    _tamper(
        db,
        "UPDATE audit_events SET seq = -3 WHERE seq = 3",
        "UPDATE audit_events SET seq = 3 WHERE seq = 5",
        "UPDATE audit_events SET seq = 5 WHERE seq = -3",
    )
    with db.connect() as connection:
        moved = connection.exec_driver_sql("SELECT payload FROM audit_events WHERE seq = 3")
        assert moved.scalar_one()["i"] == 4
    code, output = _verify_cli(tmp_path, _export(log), signer.public_key_pem())
    assert code == 1
    assert "FAILED at event 3" in output


def test_rewritten_chain_resigned_with_another_key_is_caught(
    tmp_path: Path, log: AuditLog, signer: CheckpointSigner
) -> None:
    """An attacker who edits event 2 and recomputes every later hash still cannot produce the
    gateway's signature; signing with their own key is caught."""
    lines = _export(log)
    events = [
        EventRecord(**{k: v for k, v in json.loads(x).items() if k != "record"}) for x in lines[:-1]
    ]
    forged: list[EventRecord] = []
    prev = events[0].prev_hash
    for record in events:
        payload = {**record.payload, "i": 1000} if record.seq == 2 else record.payload
        fields = {**record.__dict__, "payload": payload, "prev_hash": prev}
        fields["event_hash"] = event_hash(**{k: v for k, v in fields.items() if k != "event_hash"})
        forged.append(EventRecord(**fields))
        prev = fields["event_hash"]
    statement = {k: v for k, v in json.loads(lines[-1]).items() if k not in ("record", "signature")}
    statement["head_hash"] = forged[-1].event_hash
    other = CheckpointSigner.load_or_create(tmp_path / "attacker.pem")
    resigned = [encode_event(r, "jsonl") for r in forged] + [
        encode_checkpoint(other.sign(statement), "jsonl")
    ]
    code, output = _verify_cli(tmp_path, resigned, signer.public_key_pem())
    assert code == 1
    assert f"FAILED at event {EVENTS}" in output
    assert "checkpoint signature does not verify" in output
    # With the attacker's key the forgery is self-consistent: only the real key catches it.
    assert _verify_cli(tmp_path, resigned, other.public_key_pem())[0] == 0


def test_truncate_update_delete_refused_by_postgres(db: sa.Engine, log: AuditLog) -> None:
    for statement in (
        "TRUNCATE audit_events",
        "UPDATE audit_events SET kind = 'x'",
        "DELETE FROM audit_events",
    ):
        with pytest.raises(DBAPIError, match="append-only"), db.begin() as connection:
            connection.exec_driver_sql(statement)
    assert log.head()[0] == EVENTS


def test_verify_cli_rejects_bad_key_file(tmp_path: Path, log: AuditLog) -> None:
    code, output = _verify_cli(tmp_path, _export(log), b"not a key")
    assert code == 1
    assert "not a PEM public key" in output
