"""The tamper matrix: what someone with full control of the PostgreSQL database (owner or
superuser, triggers switched off) but without the gateway's signing and MAC keys can do, and
who catches it, naming the first bad event:

- the gateway's own check (its last signed checkpoint kept in a local file, its MAC key);
- offline ``specgate audit verify`` with a checkpoint the auditor already holds (and the MAC
  key), over an export signed by a gateway that has lost its state and has no MAC key (the
  worst case short of stolen keys) or over an export the attacker assembles from the database
  and a genuine checkpoint found in it;
- the witness, over real HTTP, where the attack changes the signed tree, or where the gateway
  serving it raised its tamper alarm. An edited row whose tree was not recomputed leaves the
  signed heads intact, but even a gateway without state or MAC key finds it and alarms; a
  forged event appended at the head is caught by the MACs alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError
from typer.testing import CliRunner

from gateway.audit.canonical import GENESIS_HASH, event_bytes, format_timestamp
from gateway.audit.log import AuditLog, TamperDetectedError
from gateway.audit.mac import EventMac
from gateway.audit.merkle import CompactRange, leaf_hash
from gateway.audit.records import CheckpointRecord, TreeRecord, encode_record
from gateway.audit.schema import audit_events, audit_head, audit_merkle_nodes
from gateway.audit.signing import CheckpointSigner
from gateway.audit.witness import WitnessAlarm, witness_once
from gateway.db import make_db_engine
from gateway.keys import KeyStore
from tests.audit_helpers import admin_cli, audit_only_app, serve

EVENTS = 15  # the auditor key's `key` event and 14 requests; the checkpoint of 15 is event 16
MAC = EventMac(b"s" * 32)
Row = dict[str, Any]


@dataclass
class World:
    db: sa.Engine
    signer: CheckpointSigner
    gateway: AuditLog
    keys: KeyStore
    auditor_key: str
    trusted: str  # the checkpoint note of size EVENTS the auditor and the witness hold
    tmp: Path


@pytest.fixture
def world(pg_url: str, tmp_path: Path) -> Iterator[World]:
    db = make_db_engine(pg_url)
    signer = CheckpointSigner.load_or_create(tmp_path / "signing.pem")
    gateway = AuditLog(db, signer, MAC, tmp_path / "gateway-state.json")
    keys = KeyStore(db, gateway)
    _, auditor_key = keys.create("auditor", "compliance", "tests")
    for i in range(EVENTS - 1):
        gateway.append("request", f"key_{i % 3}", {"i": i, "user": f"user-{i}"})
    trusted = str(gateway.checkpoint()["note"])
    yield World(db, signer, gateway, keys, auditor_key, trusted, tmp_path)
    db.dispose()


# --- what the attacker does ----------------------------------------------------------------


def _read_events(connection: sa.Connection) -> list[Row]:
    rows = connection.execute(sa.select(audit_events).order_by(audit_events.c.seq))
    return [dict(row._mapping) for row in rows]


def _disable_triggers(connection: sa.Connection, enable: bool = False) -> None:
    for table in ("audit_events", "audit_merkle_nodes", "audit_head"):
        action = "ENABLE" if enable else "DISABLE"
        connection.exec_driver_sql(f"ALTER TABLE {table} {action} TRIGGER ALL")


def rewrite(db: sa.Engine, change: Callable[[list[Row]], list[Row]]) -> None:
    """Change the events, then recompute every chain hash, the whole Merkle tree and the
    head row so that the database is self-consistent (MACs stay as they were: no key)."""
    with db.begin() as connection:
        _disable_triggers(connection)
        events = change(_read_events(connection))
        prev, compact, nodes = GENESIS_HASH, CompactRange(), []
        for event in events:
            event["prev_hash"] = prev
            data = event_bytes(
                **{k: event[k] for k in ("seq", "event_id", "kind", "actor", "payload")},
                created_at=format_timestamp(event["created_at"]),
                prev_hash=prev,
            )
            event["event_hash"] = prev = hashlib.sha256(data).hexdigest()
            nodes += [
                {"level": n[0], "idx": n[1], "hash": h}
                for n, h in compact.append(leaf_hash(data))
                if n[0]  # leaves are not stored
            ]
        connection.execute(sa.delete(audit_events))
        connection.execute(sa.delete(audit_merkle_nodes))
        if events:
            connection.execute(sa.insert(audit_events), events)
            connection.execute(sa.insert(audit_merkle_nodes), nodes)
        connection.execute(
            sa.update(audit_head).values(
                tree_size=compact.size, head_hash=prev, frontier=b"".join(compact.hashes)
            )
        )
        _disable_triggers(connection, enable=True)


def edit_payload(db: sa.Engine) -> None:
    with db.begin() as connection:
        _disable_triggers(connection)
        connection.exec_driver_sql(
            'UPDATE audit_events SET payload = \'{"i": 2, "user": "nobody"}\' WHERE seq = 4'
        )
        _disable_triggers(connection, enable=True)


def consistent_rewrite(db: sa.Engine) -> None:
    def change(events: list[Row]) -> list[Row]:
        events[3]["payload"] = {**events[3]["payload"], "user": "nobody"}
        return events

    rewrite(db, change)


def _forged(seq: int, template: Row) -> Row:
    return {**template, "seq": seq, "event_id": f"00000000-0000-4000-8000-{seq:012d}", "mac": None}


def forged_insert_at_head(db: sa.Engine) -> None:
    rewrite(db, lambda events: [*events, _forged(len(events) + 1, events[-2])])


def forged_insert_in_the_middle(db: sa.Engine) -> None:
    def change(events: list[Row]) -> list[Row]:
        shifted = [{**e, "seq": e["seq"] + 1} for e in events[4:]]
        return [*events[:4], _forged(5, events[4]), *shifted]

    rewrite(db, change)


def delete_last_five(db: sa.Engine) -> None:
    rewrite(db, lambda events: events[:-5])


def swap_rows(db: sa.Engine) -> None:
    def change(events: list[Row]) -> list[Row]:
        third, fifth = events[2], events[4]
        events[2], events[4] = {**fifth, "seq": 3}, {**third, "seq": 5}
        return events

    rewrite(db, change)


def fork(db: sa.Engine) -> None:
    """Rewrite event 4 and drop the checkpoint event, so the tree has the trusted size again:
    a second, different tree of the same size."""

    def change(events: list[Row]) -> list[Row]:
        events[3]["payload"] = {**events[3]["payload"], "user": "nobody"}
        return events[:EVENTS]

    rewrite(db, change)


@dataclass(frozen=True)
class Attack:
    name: str
    run: Callable[[sa.Engine], None]
    first_bad_seq: int
    witness_alarm: str | None  # None: the tree only grew and its gateway is not alarmed


ATTACKS = [
    Attack("payload edit", edit_payload, 4, "gateway_alarm"),
    Attack("consistent rewrite from seq 4", consistent_rewrite, 4, "rewrite"),
    Attack("forged insert at the head", forged_insert_at_head, EVENTS + 2, None),
    Attack("forged insert in the middle", forged_insert_in_the_middle, 5, "rewrite"),
    Attack("deletion of the last 5 events", delete_last_five, EVENTS - 3, "truncation"),
    Attack("swap of two rows", swap_rows, 3, "rewrite"),
    Attack("fork (two checkpoints of one size)", fork, 4, "fork"),
]


# --- who catches it ------------------------------------------------------------------------


def verify_cli(world: World, lines: list[str], *, mac: bool = True) -> tuple[int, str]:
    export = world.tmp / "export.jsonl"
    export.write_text("".join(lines), encoding="utf-8")
    pem = world.tmp / "pub.pem"
    pem.write_bytes(world.signer.public_key_pem())
    trusted = world.tmp / "trusted.checkpoint"
    trusted.write_text(world.trusted, encoding="utf-8")
    key = world.tmp / "mac.key"
    key.write_text((b"s" * 32).hex())
    args = ["audit", "verify", str(export), "--public-key", str(pem)]
    args += ["--trusted-checkpoint", str(trusted)]
    args += ["--mac-key", str(key)] if mac else []
    result = CliRunner().invoke(admin_cli(), args)
    return result.exit_code, result.output


def attacker_export(db: sa.Engine) -> list[str] | None:
    """The database's events under the newest genuine checkpoint still in it, shaped as an
    export (what an attacker without the signing key can hand an auditor)."""
    with db.connect() as connection:
        events = _read_events(connection)
    notes = [e["payload"]["note"] for e in events if e["kind"] == "checkpoint"]
    if not notes:
        return None
    size = int(notes[-1].split("\n")[1])
    lines = [encode_record(TreeRecord(0, (), ()), "jsonl")]
    for event in events[:size]:
        fields = {**event, "created_at": format_timestamp(event["created_at"])}
        lines.append(
            json.dumps(
                {"record": "event", **fields},
                sort_keys=True,
                separators=(",", ":"),
                ensure_ascii=False,
            )
            + "\n"
        )
    return [*lines, encode_record(CheckpointRecord(notes[-1]), "jsonl")]


def stateless_export(world: World) -> list[str] | None:
    """An export signed by a gateway with the signing key but no state file and no MAC key."""
    stateless = AuditLog(world.db, world.signer)
    # The export event makes the tree one larger; a proof from 15 exists only if it reaches 15.
    since = EVENTS if stateless.head()[0] + 1 >= EVENTS else None
    try:
        return list(stateless.export(None, None, "jsonl", "auditor", consistency_from=since))
    except TamperDetectedError:
        return None  # even that gateway refuses: the rows do not hash as stored


def test_untouched_log_verifies_everywhere(world: World) -> None:
    lines = list(world.gateway.export(None, None, "jsonl", "auditor", consistency_from=EVENTS))
    code, output = verify_cli(world, lines)
    assert code == 0, output
    assert "consistent with the trusted checkpoint of size 15" in output
    assert world.gateway.verify().ok
    with serve(audit_only_app(world.gateway, world.keys, world.db)) as url:
        first = witness_once(url, world.auditor_key, world.tmp / "witness", "w")
        world.gateway.append("request", "key_0", {"i": 99})
        world.gateway.checkpoint()
        second = witness_once(url, world.auditor_key, world.tmp / "witness", "w")
    # Checkpoints of 15 (event 16), of 17 (closing the export, event 18), of 18 (verify).
    assert (first.old_size, first.checkpoint.size) == (None, 18)
    assert (second.old_size, second.checkpoint.size) == (18, 20)


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_tampering_is_detected_and_located(world: World, attack: Attack) -> None:
    witness_state = world.tmp / "witness"
    with serve(audit_only_app(world.gateway, world.keys, world.db)) as url:
        witness_once(url, world.auditor_key, witness_state, "w")  # cosigns the size-15 tree
    attack.run(world.db)

    # The witness, served by a gateway that signs whatever the database holds.
    stateless = AuditLog(world.db, world.signer)
    with contextlib.suppress(TamperDetectedError):
        stateless.checkpoint()
    with serve(audit_only_app(stateless, world.keys, world.db)) as url:
        if attack.witness_alarm is None:
            witness_once(url, world.auditor_key, witness_state, "w")
        else:
            with pytest.raises(WitnessAlarm) as alarm:
                witness_once(url, world.auditor_key, witness_state, "w")
            assert alarm.value.kind == attack.witness_alarm

    # Offline verification with the trusted checkpoint catches every export on offer.
    exports = [e for e in (stateless_export(world), attacker_export(world.db)) if e]
    assert exports
    for lines in exports:
        code, output = verify_cli(world, lines)
        assert code == 1
        assert f"FAILED at event {attack.first_bad_seq} " in output, output
        if attack.witness_alarm is not None:  # the tree changed: caught even without MACs
            code, output = verify_cli(world, lines, mac=False)
            assert code == 1, output

    # The gateway's own check names the first bad event and raises the alarm.
    report = world.gateway.verify()
    assert (report.ok, report.first_bad_seq) == (False, attack.first_bad_seq), report.reason
    assert not world.gateway.integrity_ok()
    with pytest.raises(TamperDetectedError):
        world.gateway.checkpoint()  # no further checkpoints over the bad history


def test_alarm_is_recorded_and_signing_stops(world: World) -> None:
    consistent_rewrite(world.db)
    with pytest.raises(TamperDetectedError) as raised:
        world.gateway.checkpoint()
    assert raised.value.first_bad_seq == 4
    with world.db.connect() as connection:
        alarms = connection.execute(
            sa.select(audit_events.c.payload).where(audit_events.c.kind == "tamper_detected")
        ).all()
    assert [a.payload["first_bad_seq"] for a in alarms] == [4]
    # A restarted gateway reads its signed state from the file and sees the same.
    restarted = AuditLog(world.db, world.signer, MAC, world.tmp / "gateway-state.json")
    with pytest.raises(TamperDetectedError, match="event 4"):
        restarted.checkpoint()


def test_deleting_unsigned_recent_events_is_caught_by_the_writer(world: World) -> None:
    """Events appended after the last checkpoint are not yet signed, but the gateway that
    wrote them remembers the tree it left, so their deletion is still caught."""
    for i in range(3):
        world.gateway.append("request", "key_0", {"late": i})
    rewrite(world.db, lambda events: events[:-3])
    with pytest.raises(TamperDetectedError) as raised:
        world.gateway.checkpoint()
    assert raised.value.first_bad_seq == EVENTS + 2


def test_owner_cannot_bypass_append_only_without_disabling_triggers(world: World) -> None:
    for statement in (
        "TRUNCATE audit_events",
        "UPDATE audit_events SET kind = 'x'",
        "DELETE FROM audit_events",
        "TRUNCATE audit_merkle_nodes",
        "UPDATE audit_merkle_nodes SET level = 9",
        "DELETE FROM audit_merkle_nodes",
        "DELETE FROM audit_head",
    ):
        with pytest.raises(DBAPIError, match="append-only"), world.db.begin() as connection:
            connection.exec_driver_sql(statement)
    assert world.gateway.verify().ok


def test_verify_cli_rejects_bad_key_file(world: World) -> None:
    lines = list(world.gateway.export(None, None, "jsonl", "auditor"))
    export = world.tmp / "e.jsonl"
    export.write_text("".join(lines))
    bad = world.tmp / "bad.pem"
    bad.write_bytes(b"not a key")
    result = CliRunner().invoke(
        admin_cli(), ["audit", "verify", str(export), "--public-key", str(bad)]
    )
    assert result.exit_code == 1
    assert "not a PEM public key" in result.output
