"""Offline verification of exports: the canonical serialisation over arbitrary payloads, and
every kind of corruption of an export file is caught and the first bad event named."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.audit.canonical import GENESIS_HASH, event_hash, format_timestamp
from gateway.audit.log import AuditLog
from gateway.audit.mac import EventMac
from gateway.audit.merkle import CompactRange, leaf_hash
from gateway.audit.records import (
    CheckpointRecord,
    EventRecord,
    ExportFormat,
    TreeRecord,
    csv_header,
    encode_record,
)
from gateway.audit.signing import CheckpointSigner
from gateway.audit.verify import verify_export
from gateway.db import make_db_engine, upgrade_database

SIGNER = CheckpointSigner(Ed25519PrivateKey.generate())
PUBLIC_PEM = SIGNER.public_key_pem()
MAC = EventMac(b"m" * 32)
START = datetime(2026, 1, 1, tzinfo=UTC)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
payloads = st.dictionaries(st.text(max_size=8), json_values, max_size=5)


def build_export(
    payload_list: list[dict[str, Any]],
    fmt: ExportFormat = "jsonl",
    first_seq: int = 1,
    prev_hash: str = GENESIS_HASH,
) -> list[str]:
    """An export as the gateway writes it, built without a database: the leaves before
    ``first_seq`` are made up, the checkpoint covers up to the last event."""
    frontier = CompactRange()
    for i in range(first_seq - 1):
        frontier.append(leaf_hash(f"earlier {i}".encode()))
    tree = TreeRecord(start=first_seq - 1, left=tuple(frontier.hashes), right=())
    records = []
    for offset, payload in enumerate(payload_list):
        fields: dict[str, Any] = {
            "seq": first_seq + offset,
            "event_id": str(uuid.UUID(int=first_seq + offset)),
            "created_at": format_timestamp(START + timedelta(milliseconds=offset)),
            "kind": "request",
            "actor": "key_app" if offset % 2 else None,
            "payload": payload,
            "prev_hash": prev_hash,
        }
        prev_hash = event_hash(**fields)
        record = EventRecord(**fields, event_hash=prev_hash)
        record = EventRecord(**{**record.__dict__, "mac": MAC.mac(record.canonical_bytes())})
        frontier.append(leaf_hash(record.canonical_bytes()))
        records.append(record)
    note = SIGNER.sign_checkpoint(frontier.size, frontier.root())
    lines = [csv_header()] if fmt == "csv" else []
    lines += [encode_record(tree, fmt)]
    lines += [encode_record(record, fmt) for record in records]
    return [*lines, encode_record(CheckpointRecord(note), fmt)]


SIX = [{"i": i, "text": f"événement\u001f{i}"} for i in range(6)]


@settings(deadline=None)
@given(st.lists(payloads, min_size=1, max_size=5), st.sampled_from(["jsonl", "csv"]))
def test_any_payloads_export_and_verify(
    payload_list: list[dict[str, Any]], fmt: ExportFormat
) -> None:
    lines = build_export(payload_list, fmt, first_seq=41, prev_hash="ab" * 32)
    report = verify_export(lines, PUBLIC_PEM, mac=MAC)
    assert (report.ok, report.events_checked, report.first_bad_seq) == (
        True,
        len(payload_list),
        None,
    )


@settings(deadline=None)
@given(st.lists(payloads, min_size=2, max_size=4), st.data())
def test_any_changed_payload_is_named(
    payload_list: list[dict[str, Any]], data: st.DataObject
) -> None:
    lines = build_export(payload_list)
    index = data.draw(st.integers(0, len(payload_list) - 1))
    replacement = data.draw(payloads.filter(lambda p: p != payload_list[index]))
    fields = json.loads(lines[index + 1])
    del fields["record"]
    lines[index + 1] = encode_record(EventRecord(**{**fields, "payload": replacement}), "jsonl")
    report = verify_export(lines, PUBLIC_PEM)
    assert (report.ok, report.first_bad_seq) == (False, index + 1)
    assert "altered" in report.reason


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["jsonl", "csv"]), st.data())
def test_every_flipped_bit_is_caught(fmt: ExportFormat, data: st.DataObject) -> None:
    lines = build_export(SIX, fmt)
    index = data.draw(st.integers(0, len(lines) - 1))
    raw = bytearray(lines[index].encode("utf-8"))
    position = data.draw(st.integers(0, len(raw) - 1))
    raw[position] ^= 1 << data.draw(st.integers(0, 7))
    lines[index] = raw.decode("utf-8", errors="replace")
    report = verify_export(lines, PUBLIC_PEM, mac=MAC)
    assert not report.ok
    seq = index - (1 if fmt == "csv" else 0)  # the tree record is line 0 (after the header)
    if 1 <= seq <= len(SIX):
        assert report.first_bad_seq == seq
    elif seq == len(SIX) + 1:
        assert report.first_bad_seq in (len(SIX), len(SIX) + 1)


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_truncated_exports_are_caught(fmt: ExportFormat) -> None:
    lines = build_export(SIX, fmt)
    header = 1 if fmt == "csv" else 0
    for keep in range(header + 1, len(lines)):
        report = verify_export(lines[:keep], PUBLIC_PEM)
        assert not report.ok
        assert report.first_bad_seq == keep - header
        assert "truncated" in report.reason
    text = "".join(lines)
    for cut in range(1, len(text), 37):
        assert not verify_export(text[:cut].splitlines(keepends=True), PUBLIC_PEM).ok


def test_dropped_first_events_are_caught() -> None:
    lines = build_export(SIX)
    report = verify_export([lines[0], *lines[3:]], PUBLIC_PEM)
    assert (report.ok, report.first_bad_seq) == (False, 1)
    assert "expected event 1, found event 3" in report.reason
    # Dropping the tree record too leaves an export that does not say where it starts.
    assert not verify_export(lines[3:], PUBLIC_PEM).ok


def test_dropped_middle_event_is_named() -> None:
    lines = build_export(SIX)
    del lines[4]
    report = verify_export(lines, PUBLIC_PEM)
    assert (report.ok, report.first_bad_seq, report.events_checked) == (False, 4, 3)


@pytest.mark.parametrize("index", range(len(SIX) - 1))
def test_swapped_lines_are_named(index: int) -> None:
    """Named at the first position where the order breaks (the tree record says where the
    export starts)."""
    lines = build_export(SIX)
    lines[index + 1], lines[index + 2] = lines[index + 2], lines[index + 1]
    report = verify_export(lines, PUBLIC_PEM)
    assert (report.ok, report.first_bad_seq) == (False, index + 1)
    assert "reordered" in report.reason


def test_duplicated_line_and_data_after_checkpoint_are_caught() -> None:
    lines = build_export(SIX)
    assert verify_export([*lines[:4], lines[3], *lines[4:]], PUBLIC_PEM).first_bad_seq == 4
    report = verify_export([*lines, lines[1]], PUBLIC_PEM)
    assert not report.ok
    assert "after the checkpoint" in report.reason


def test_other_key_and_non_canonical_lines_are_caught() -> None:
    lines = build_export(SIX)
    other = CheckpointSigner(Ed25519PrivateKey.generate()).public_key_pem()
    report = verify_export(lines, other)
    assert (report.ok, report.first_bad_seq) == (False, len(SIX))
    assert "signature" in report.reason
    spaced = [*lines]
    spaced[3] = spaced[3].replace('"kind":', '"kind": ')
    report = verify_export(spaced, PUBLIC_PEM)
    assert (report.ok, report.first_bad_seq) == (False, 3)
    assert "canonical" in report.reason


def test_empty_input_fails() -> None:
    assert verify_export([], PUBLIC_PEM).reason == "the export is empty"


@pytest.fixture(params=["postgresql", "sqlite"])
def log(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[AuditLog]:
    if request.param == "postgresql":
        url = str(request.getfixturevalue("pg_url"))
    else:
        url = f"sqlite:///{tmp_path / 'audit.db'}"
        upgrade_database(url)
    db: sa.Engine = make_db_engine(url)
    yield AuditLog(db, SIGNER, MAC)
    db.dispose()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(payload=payloads)
def test_any_payload_survives_storage(log: AuditLog, payload: dict[str, Any]) -> None:
    """What the database hands back hashes the same as what was appended."""
    since = datetime.now(UTC)
    appended = log.append("request", "a", payload)
    lines = list(log.export(since, None, "jsonl"))
    report = verify_export(lines, PUBLIC_PEM, mac=MAC)
    assert report.ok, report.reason
    assert json.loads(lines[1])["event_hash"] == appended.event_hash
