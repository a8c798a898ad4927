"""Upgrading a log written at revision 0001 (no MACs, no tree): migration 0002 adopts its
events as *legacy* (seqs 1..N), the first event written after it is a MAC'd
``legacy_adopted`` declaration of N that every later checkpoint commits to, and verification
accepts MAC-less events only before that declaration. On PostgreSQL and SQLite.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from alembic import command
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gateway.audit.canonical import GENESIS_HASH, event_bytes, format_timestamp
from gateway.audit.legacy import LEGACY_KIND, LegacyPrefix, declaration_payload
from gateway.audit.log import (
    AuditLog,
    AuditUnavailableError,
    TamperDetectedError,
    _frontier,
    read_nodes,
    record_from_row,
)
from gateway.audit.mac import EventMac
from gateway.audit.merkle import CompactRange, leaf_hash, perfect_pieces, range_hash, reference_root
from gateway.audit.receipt import verify_receipt
from gateway.audit.records import EventRecord
from gateway.audit.schema import audit_events, audit_head, audit_merkle_nodes
from gateway.audit.signing import CheckpointSigner
from gateway.audit.verify import verify_export
from gateway.db import alembic_config, make_db_engine, upgrade_database
from tests.api_harness import gateway_settings, live_gateway
from tests.conftest import PG_SERVER
from tests.tiny_models import build_pair

ADOPT_PAGE = importlib.import_module("migrations.versions.0002_merkle_tree_mac_roles").ADOPT_PAGE
LEGACY = 9  # events written at revision 0001, one of them a 0001-style checkpoint
MAC = EventMac(b"k" * 32)


def write_revision_0001_log(url: str, count: int = LEGACY) -> None:
    """A database at revision 0001 holding ``count`` hash-chained events, as 0001's code wrote
    them (its checkpoint events carry a signed JSON statement, not a C2SP note)."""
    db = make_db_engine(url)
    config = alembic_config()
    events = sa.table(
        "audit_events",
        *(sa.column(c) for c in ("seq", "event_id", "kind", "actor", "prev_hash", "event_hash")),
        sa.column("created_at", sa.DateTime(timezone=True)),
        sa.column("payload", sa.JSON),
    )
    with db.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0001")
        prev, start = GENESIS_HASH, datetime(2026, 11, 30, 8, 0, tzinfo=UTC)
        rows: list[dict[str, Any]] = []
        for seq in range(1, count + 1):
            kind, payload = "request", {"seq_was": seq, "user": f"user-{seq}"}
            if seq == 5:
                kind, payload = "checkpoint", {"seq": 4, "head_hash": prev, "signature": "c2ln"}
            created_at = start + timedelta(seconds=seq)
            row = {
                "seq": seq,
                "event_id": str(uuid.UUID(int=seq)),
                "kind": kind,
                "actor": "key_old",
                "payload": payload,
                "prev_hash": prev,
            }
            data = event_bytes(**row, created_at=format_timestamp(created_at))
            prev = hashlib.sha256(data).hexdigest()
            rows.append({**row, "created_at": created_at, "event_hash": prev})
        connection.execute(sa.insert(events), rows)
    db.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def old_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database (not migrated) on PostgreSQL or SQLite."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'old.db'}"
        return
    import psycopg
    from psycopg import sql

    name = f"specgate_legacy_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{PG_SERVER}/test", autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield f"{PG_SERVER}/{name}"
    finally:
        with psycopg.connect(f"{PG_SERVER}/test", autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@dataclass
class Upgraded:
    db: sa.Engine
    signer: CheckpointSigner
    gateway: AuditLog
    tmp: Path

    def fresh_replica(self) -> AuditLog:
        """Another gateway with the keys but no signed state of its own."""
        return AuditLog(self.db, self.signer, MAC, self.tmp / f"{uuid.uuid4().hex}.json")

    def offline(self, gateway: AuditLog | None = None) -> Any:
        """Offline verification with the MAC key of an export by ``gateway``, or else of the
        whole database as it is, under a checkpoint signed over it unchecked (the worst case:
        a gateway without the MAC key and without state signed whatever it found)."""
        lines = list(gateway.export(None, None)) if gateway else self._signed_as_found()
        return verify_export(lines, self.signer.public_key_pem(), mac=MAC)

    def _signed_as_found(self) -> list[str]:
        with self.db.connect() as connection:
            size = connection.execute(sa.select(audit_head.c.tree_size)).scalar_one()
            stored = read_nodes(connection, set(perfect_pieces(0, size)))
        note = self.signer.sign_checkpoint(size, range_hash(0, size, stored.__getitem__))
        exporter = AuditLog(self.db, self.signer)
        return list(exporter._export_lines(1, size, {"note": note, "size": size}, "jsonl"))


@pytest.fixture
def upgraded(old_url: str, tmp_path: Path) -> Iterator[Upgraded]:
    write_revision_0001_log(old_url)
    upgrade_database(old_url)
    db = make_db_engine(old_url)
    signer = CheckpointSigner.load_or_create(tmp_path / "signing.pem")
    yield Upgraded(db, signer, AuditLog(db, signer, MAC, tmp_path / "state.json"), tmp_path)
    db.dispose()


def _rows_in(connection: sa.Connection) -> list[Any]:
    return list(connection.execute(sa.select(audit_events).order_by(audit_events.c.seq)))


def _rows(db: sa.Engine) -> list[Any]:
    with db.connect() as connection:
        return _rows_in(connection)


def test_migration_builds_the_tree_an_append_of_the_events_would_have(upgraded: Upgraded) -> None:
    rows = _rows(upgraded.db)
    assert [row.seq for row in rows] == list(range(1, LEGACY + 1))
    assert all(row.mac is None for row in rows)
    leaves = [leaf_hash(record_from_row(row).canonical_bytes()) for row in rows]
    with upgraded.db.connect() as connection:
        head = connection.execute(sa.select(audit_head)).one()
        nodes = {
            (level, idx): bytes(digest)
            for level, idx, digest in connection.execute(sa.select(audit_merkle_nodes))
        }
    assert (head.tree_size, head.legacy_size, head.head_hash) == (
        LEGACY,
        LEGACY,
        rows[-1].event_hash,
    )
    # 9 leaves: perfect subtrees of 8 and 1; stored nodes are every complete interior node.
    assert bytes(head.frontier) == reference_root(leaves[:8]) + leaves[8]
    expected = {
        (level, idx): reference_root(leaves[idx << level : (idx + 1) << level])
        for level in (1, 2, 3)
        for idx in range(LEGACY >> level)
    }
    assert nodes == expected


def test_a_log_longer_than_a_page_is_adopted_page_by_page(old_url: str, tmp_path: Path) -> None:
    count = 2 * ADOPT_PAGE + 3
    write_revision_0001_log(old_url, count)
    upgrade_database(old_url)
    db = make_db_engine(old_url)
    rows = _rows(db)
    leaves = [leaf_hash(record_from_row(row).canonical_bytes()) for row in rows]
    with db.connect() as connection:
        head = connection.execute(sa.select(audit_head)).one()
        stored = read_nodes(connection, set(perfect_pieces(0, count)))
        node_count = connection.execute(sa.select(sa.func.count()).select_from(audit_merkle_nodes))
        assert node_count.scalar_one() == count - count.bit_count()  # every complete node
    assert range_hash(0, count, stored.__getitem__) == reference_root(leaves)
    assert _frontier(head.tree_size, head.frontier).root() == reference_root(leaves)
    gateway = AuditLog(db, CheckpointSigner.load_or_create(tmp_path / "k.pem"), MAC)
    gateway.append("request", "key_new", {"user": "new"})
    assert gateway.verify().ok
    db.dispose()


def test_upgraded_log_appends_and_verifies_with_the_mac_key(upgraded: Upgraded) -> None:
    appended = upgraded.gateway.append("request", "key_new", {"user": "new"})
    rows = _rows(upgraded.db)
    declaration = rows[LEGACY]
    assert (declaration.seq, declaration.kind) == (LEGACY + 1, LEGACY_KIND)
    assert declaration.payload == {"legacy_size": LEGACY}
    assert MAC.valid(record_from_row(declaration).canonical_bytes(), declaration.mac)
    assert appended.seq == LEGACY + 2
    checkpoint = upgraded.gateway.checkpoint()
    assert checkpoint["size"] == LEGACY + 2
    report = upgraded.offline(upgraded.gateway)
    assert report.ok, report.reason
    assert report.events_checked == LEGACY + 3  # the declaration, the request, the checkpoint
    assert upgraded.gateway.verify().ok
    assert upgraded.fresh_replica().verify().ok  # the whole log from seq 1, by the gateway


def test_a_writer_without_the_mac_key_cannot_write_the_declaration(upgraded: Upgraded) -> None:
    """Say the key CLI on a host without the MAC key runs before the gateway: refused, and
    nothing is written, so the gateway still writes a MAC'd declaration afterwards."""
    with pytest.raises(AuditUnavailableError, match="must carry a MAC"):
        AuditLog(upgraded.db).append("key", "cli:root", {"action": "created"})
    assert len(_rows(upgraded.db)) == LEGACY
    upgraded.gateway.append("request", "key_new", {"user": "new"})
    assert _rows(upgraded.db)[LEGACY].kind == LEGACY_KIND


def test_an_export_of_legacy_events_only_reaches_the_declaration(upgraded: Upgraded) -> None:
    upgraded.gateway.append("request", "key_new", {"user": "new"})
    until = datetime(2026, 11, 30, 8, 0, 4, tzinfo=UTC)  # events 1..3
    lines = list(upgraded.gateway.export(None, until))
    report = verify_export(lines, upgraded.signer.public_key_pem(), mac=MAC)
    assert report.ok, report.reason
    assert report.events_checked == LEGACY + 1


def _as_attacker(connection: sa.Connection) -> None:
    """Owner or superuser: switch the append-only triggers off."""
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql("SET session_replication_role = replica")
    else:
        for table in ("audit_events", "audit_merkle_nodes"):
            for name in ("update", "delete"):
                connection.exec_driver_sql(f"DROP TRIGGER IF EXISTS {table}_no_{name}")


def _rewrite_consistently(db: sa.Engine, seq: int, payload: dict[str, Any]) -> None:
    """Change event ``seq``'s payload and recompute every chain hash, the whole tree and the
    head row (MACs stay as they were: no key)."""
    with db.begin() as connection:
        _as_attacker(connection)
        rows = [dict(row._mapping) for row in _rows_in(connection)]
        rows[seq - 1]["payload"] = payload
        frontier, prev, nodes = CompactRange(), GENESIS_HASH, []
        for row in rows:
            row["prev_hash"] = prev
            data = record_from_row(SimpleNamespace(**row)).canonical_bytes()  # type: ignore[arg-type]
            row["event_hash"] = prev = hashlib.sha256(data).hexdigest()
            nodes += [
                {"level": n[0], "idx": n[1], "hash": h}
                for n, h in frontier.append(leaf_hash(data))
                if n[0]
            ]
        connection.execute(sa.delete(audit_events))
        connection.execute(sa.delete(audit_merkle_nodes))
        connection.execute(sa.insert(audit_events), rows)
        connection.execute(sa.insert(audit_merkle_nodes), nodes)
        connection.execute(
            sa.update(audit_head).values(
                tree_size=frontier.size, head_hash=prev, frontier=b"".join(frontier.hashes)
            )
        )


def test_a_consistent_rewrite_of_legacy_events_after_a_checkpoint_is_detected(
    upgraded: Upgraded,
) -> None:
    upgraded.gateway.append("request", "key_new", {"user": "new"})
    trusted = str(upgraded.gateway.checkpoint()["note"])
    _rewrite_consistently(upgraded.db, 3, {"seq_was": 3, "user": "nobody"})
    lines = upgraded._signed_as_found()
    for mac in (MAC, None):
        report = verify_export(
            lines, upgraded.signer.public_key_pem(), mac=mac, trusted_checkpoint=trusted
        )
        assert not report.ok
        assert report.first_bad_seq == 1  # no MAC names event 3: the legacy run is named
    assert (
        "MAC-less events 1..9"
        in verify_export(lines, upgraded.signer.public_key_pem(), mac=MAC).reason
    )
    with pytest.raises(TamperDetectedError) as caught:
        upgraded.gateway.checkpoint()
    assert caught.value.first_bad_seq == 1


def _forge_at_head(db: sa.Engine, count: int = 1) -> int:
    """Append ``count`` well-formed MAC-less events at the head (correct chain, tree and head
    row); returns the first forged seq."""
    with db.begin() as connection:
        _as_attacker(connection)
        head = connection.execute(sa.select(audit_head)).one()
        frontier, prev, first = _frontier(head.tree_size, head.frontier), head.head_hash, 0
        for offset in range(count):
            seq = head.tree_size + offset + 1
            first = first or seq
            row: dict[str, Any] = {
                "seq": seq,
                "event_id": str(uuid.uuid4()),
                "kind": "request",
                "actor": "key_new",
                "payload": {"user": "forged"},
                "prev_hash": prev,
            }
            created_at = datetime.now(UTC)
            data = event_bytes(**row, created_at=format_timestamp(created_at))
            prev = hashlib.sha256(data).hexdigest()
            connection.execute(
                sa.insert(audit_events),
                [{**row, "created_at": created_at, "event_hash": prev, "mac": None}],
            )
            nodes = [
                {"level": n[0], "idx": n[1], "hash": h}
                for n, h in frontier.append(leaf_hash(data))
                if n[0]
            ]
            if nodes:
                connection.execute(sa.insert(audit_merkle_nodes), nodes)
        connection.execute(
            sa.update(audit_head).values(
                tree_size=frontier.size, head_hash=prev, frontier=b"".join(frontier.hashes)
            )
        )
    return first


def test_a_mac_less_event_after_the_legacy_range_is_forged(upgraded: Upgraded) -> None:
    upgraded.gateway.append("request", "key_new", {"user": "new"})
    forged = _forge_at_head(upgraded.db)
    report = upgraded.offline()
    assert not report.ok
    assert report.first_bad_seq == forged
    assert "has no MAC" in report.reason
    with pytest.raises(TamperDetectedError) as caught:
        upgraded.gateway.checkpoint()
    assert caught.value.first_bad_seq == forged


def test_widening_the_legacy_range_in_the_head_row_writes_no_second_declaration(
    upgraded: Upgraded,
) -> None:
    upgraded.gateway.append("request", "key_new", {"user": "new"})
    forged = _forge_at_head(upgraded.db, count=2)
    with upgraded.db.begin() as connection:
        _as_attacker(connection)
        connection.execute(sa.update(audit_head).values(legacy_size=forged + 1))
    replica = upgraded.fresh_replica()
    replica.append("request", "key_new", {"user": "after"})
    kinds = [row.kind for row in _rows(upgraded.db)]
    assert kinds.count(LEGACY_KIND) == 1
    with pytest.raises(TamperDetectedError) as caught:
        replica.checkpoint()
    assert caught.value.first_bad_seq == forged


def test_widening_the_legacy_range_by_stripping_macs_is_detected(upgraded: Upgraded) -> None:
    """The attacker strips the MACs of the declaration and the events after it (to make
    them look legacy) and edits one: no MAC'd declaration closes the MAC-less run any more."""
    for i in range(3):
        upgraded.gateway.append("request", "key_new", {"user": f"new-{i}"})
    with upgraded.db.begin() as connection:
        _as_attacker(connection)
        connection.execute(
            sa.update(audit_events).where(audit_events.c.seq > LEGACY).values(mac=None)
        )
        connection.execute(sa.update(audit_head).values(legacy_size=LEGACY + 4))
    report = upgraded.offline()
    assert not report.ok
    assert report.first_bad_seq == LEGACY + 1
    assert "legacy" in report.reason
    with pytest.raises(TamperDetectedError) as caught:
        upgraded.fresh_replica().checkpoint()
    assert caught.value.first_bad_seq == LEGACY + 1


def test_a_second_declaration_is_refused_by_the_verifier(upgraded: Upgraded) -> None:
    """Even a MAC'd declaration (from a gateway misled by a widened head row) cannot move
    the bound: only the first one counts."""
    upgraded.gateway.append("request", "key_new", {"user": "new"})
    upgraded.gateway.append(LEGACY_KIND, "specgate", {"legacy_size": LEGACY + 2})
    report = upgraded.offline()
    assert not report.ok
    assert report.first_bad_seq == LEGACY + 3


def test_a_broken_legacy_chain_is_refused_naming_the_seq(old_url: str) -> None:
    write_revision_0001_log(old_url)
    db = make_db_engine(old_url)
    with db.begin() as connection:
        _as_attacker(connection)
        connection.execute(
            sa.update(audit_events).where(audit_events.c.seq == 4).values(actor="someone")
        )
    db.dispose()
    with pytest.raises(RuntimeError, match="event 4"):
        upgrade_database(old_url)


OTHER_THREADS_LOG_LINE = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} \[")


def test_serve_names_a_failed_migration_in_one_line(tmp_path: Path) -> None:
    old_url = f"sqlite:///{tmp_path / 'old.db'}"
    target, _ = build_pair(tmp_path / "models")
    write_revision_0001_log(old_url)
    db = make_db_engine(old_url)
    with db.begin() as connection:
        _as_attacker(connection)
        connection.execute(
            sa.update(audit_events).where(audit_events.c.seq == 4).values(actor="someone")
        )
    db.dispose()
    from gateway.cli import app

    result = CliRunner().invoke(
        app, ["serve", "--database-url", old_url, "--target", str(target), "--method", "none"]
    )
    assert result.exit_code == 2
    # The runner captures the whole process's output: a log line that another test's
    # background thread writes meanwhile is not the command's.
    lines = [
        line for line in result.output.splitlines()
        if line.strip() and not OTHER_THREADS_LOG_LINE.match(line)
    ]
    assert len(lines) == 1, result.output
    assert "migration" in lines[0] and "event 4" in lines[0]
    assert "Traceback" not in result.output
    upgrade = CliRunner().invoke(app, ["db", "upgrade", "--database-url", old_url])
    assert upgrade.exit_code == 1
    assert upgrade.output.strip().count("\n") == 0 and "event 4" in upgrade.output


def _synthetic_log(legacy: int, after: int) -> list[EventRecord]:
    """``legacy`` MAC-less events, the declaration (if any legacy), ``after`` MAC'd events."""
    records = []
    for seq in range(1, legacy + after + (legacy > 0) + 1):
        kind, payload = "request", {"i": seq}
        if legacy and seq == legacy + 1:
            kind, payload = LEGACY_KIND, declaration_payload(legacy)
        record = EventRecord(
            seq,
            str(uuid.UUID(int=seq)),
            "2026-12-01T00:00:00.000000+00:00",
            kind,
            None,
            payload,
            GENESIS_HASH,
            "",
        )
        if seq > legacy:
            record = replace(record, mac=MAC.mac(record.canonical_bytes()))
        records.append(record)
    return records


def _first_problem(records: list[EventRecord], start: int) -> int | None:
    macs = LegacyPrefix(MAC)
    for record in records[start - 1 :]:
        problem = macs.event(record)
        if problem is not None:
            return problem[0]
    finished = macs.finish(len(records))
    return finished[0] if finished else None


@settings(max_examples=300, deadline=None)
@given(
    legacy=st.integers(0, 12),
    after=st.integers(0, 12),
    data=st.data(),
)
def test_a_stripped_mac_past_the_legacy_range_is_named_wherever_the_walk_starts(
    legacy: int, after: int, data: st.DataObject
) -> None:
    records = _synthetic_log(legacy, after)
    if not records:
        return
    size = len(records)
    intact_start = data.draw(st.integers(1, size), label="start")
    assert _first_problem(records, intact_start) is None
    if size == legacy:
        return
    stripped = data.draw(st.integers(legacy + 1, size), label="stripped seq")
    records[stripped - 1] = replace(records[stripped - 1], mac=None)
    start = data.draw(st.integers(1, stripped), label="start")
    assert _first_problem(records, start) == stripped


def test_an_upgraded_0001_store_serves_requests_with_receipts_and_verifies(
    old_url: str, tmp_path: Path
) -> None:
    """The gateway itself migrates a store left by revision 0001 at startup, serves, and its
    whole log (legacy events included) verifies over HTTP and offline."""
    write_revision_0001_log(old_url)
    models = build_pair(tmp_path / "models")
    settings = gateway_settings(models, tmp_path / "data", old_url, migrate=True)
    with live_gateway(settings, "legacy") as live:
        auditor = {"authorization": f"Bearer {live.keys['auditor']}"}
        response = httpx.post(
            live.base_url + "/v1/chat/completions",
            json={
                "model": "target",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
            headers={"authorization": f"Bearer {live.keys['app']}"},
            timeout=60,
        )
        assert response.status_code == 200
        assert int(response.headers["x-specgate-audit-leaf-index"]) > LEGACY
        verify = httpx.get(live.base_url + "/v1/audit/verify", headers=auditor, timeout=60)
        assert verify.status_code == 200 and verify.json()["ok"], verify.text
        legacy_id = str(uuid.UUID(int=3))
        proof = httpx.get(live.base_url + f"/v1/audit/proof/{legacy_id}", headers=auditor)
        assert proof.status_code == 200
        pem = live.services.signer.public_key_pem()
        assert verify_receipt(proof.json(), pem).startswith("event 3 ")
        export = httpx.get(live.base_url + "/v1/audit/export", headers=auditor, timeout=60)
        assert export.status_code == 200
        lines = export.text.splitlines(keepends=True)
        report = verify_export(lines, pem, mac=live.services.audit.mac)
        assert report.ok, report.reason
        kinds = [json.loads(line).get("kind") for line in lines]
        assert kinds[LEGACY + 1] == LEGACY_KIND
