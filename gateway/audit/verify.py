"""Offline verification of an audit export: needs only the export and the public key, never
the server or its database (``specgate audit verify``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from gateway.audit.records import EventRecord, RecordFormatError, decode_line, detect_format
from gateway.audit.signing import (
    CHECKPOINT_FORMAT,
    PublicKeyError,
    checkpoint_signature_valid,
    key_fingerprint,
    load_public_key,
)


@dataclass
class VerifyReport:
    ok: bool
    events_checked: int
    first_bad_seq: int | None
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _event_problem(
    record: EventRecord, previous: EventRecord | None
) -> tuple[int | None, str] | None:
    """(first bad seq, why) for an event that does not continue the chain, else None."""
    if previous is not None and record.seq != previous.seq + 1:
        expected = previous.seq + 1
        return expected, (
            f"sequence broken: expected event {expected} after event {previous.seq}, "
            f"found event {record.seq} (events missing, repeated or reordered)"
        )
    if record.computed_hash() != record.event_hash:
        return record.seq, f"event {record.seq} was altered: its event_hash does not recompute"
    if previous is not None and record.prev_hash != previous.event_hash:
        return record.seq, (
            f"event {record.seq}: prev_hash does not match the hash of event {previous.seq}"
        )
    return None


def _checkpoint_problem(
    checkpoint: dict[str, Any], first: EventRecord | None, last: EventRecord | None, count: int
) -> tuple[int | None, str] | None:
    """(first bad seq, why) when the signed checkpoint does not describe the exported events."""
    first_seq, last_seq = (first.seq if first else None), (last.seq if last else None)
    if checkpoint.get("format") != CHECKPOINT_FORMAT:
        return last_seq, f"checkpoint format is not {CHECKPOINT_FORMAT}"
    claimed_first, claimed_last = checkpoint.get("first_seq"), checkpoint.get("seq")
    if isinstance(claimed_first, int) and first_seq is not None and claimed_first < first_seq:
        return claimed_first, (
            f"the checkpoint covers events from {claimed_first} but the export starts at event "
            f"{first_seq}: events {claimed_first}..{first_seq - 1} are missing"
        )
    if isinstance(claimed_last, int) and last_seq is not None and claimed_last > last_seq:
        return last_seq + 1, (
            f"export ends at event {last_seq} but the checkpoint covers up to event "
            f"{claimed_last}: events {last_seq + 1}..{claimed_last} are missing (truncated)"
        )
    expected = {
        "first_seq": first_seq,
        "first_prev_hash": first.prev_hash if first else None,
        "seq": last_seq,
        "head_hash": last.event_hash if last else None,
        "event_count": count,
    }
    for name, value in expected.items():
        if checkpoint.get(name) != value:
            bad_seq = first_seq if name.startswith("first") else last_seq
            return bad_seq, f"checkpoint does not match the export: {name} differs"
    return None


def verify_export(lines: Iterable[str], public_key_pem: bytes) -> VerifyReport:
    """Check an export line by line: canonical form, every hash, the prev_hash links, a gapless
    sequence, and a final checkpoint that is signed by ``public_key_pem`` and matches the first
    and last exported events. Stops at, and names, the first bad event."""
    try:
        public_key = load_public_key(public_key_pem)
    except PublicKeyError as exc:
        return VerifyReport(False, 0, None, str(exc))
    iterator = iter(lines)
    first_line = next(iterator, None)
    if first_line is None:
        return VerifyReport(False, 0, None, "the export is empty")
    fmt = detect_format(first_line)
    if fmt == "csv":
        numbered = enumerate(iterator, start=2)
    else:
        numbered = enumerate(itertools.chain([first_line], iterator), start=1)

    first: EventRecord | None = None
    previous: EventRecord | None = None
    checkpoint: dict[str, Any] | None = None
    count = 0
    for line_number, line in numbered:
        next_seq = previous.seq + 1 if previous else None
        if checkpoint is not None:
            return VerifyReport(
                False, count, next_seq, f"line {line_number}: data after the checkpoint"
            )
        try:
            record = decode_line(line, fmt)
        except RecordFormatError as exc:
            return VerifyReport(False, count, next_seq, f"line {line_number}: {exc}")
        if not isinstance(record, EventRecord):
            checkpoint = record
            continue
        problem = _event_problem(record, previous)
        if problem is not None:
            return VerifyReport(False, count, *problem)
        first = first or record
        previous = record
        count += 1

    last_seq = previous.seq if previous else None
    if checkpoint is None:
        bad = last_seq + 1 if last_seq is not None else None
        return VerifyReport(False, count, bad, "no checkpoint at the end: the export is truncated")
    fingerprint = key_fingerprint(public_key)
    if not checkpoint_signature_valid(checkpoint, public_key):
        return VerifyReport(
            False,
            count,
            last_seq,
            f"checkpoint signature does not verify with the given public key ({fingerprint}; "
            f"checkpoint names {checkpoint.get('key_fingerprint')})",
        )
    problem = _checkpoint_problem(checkpoint, first, previous, count)
    if problem is not None:
        return VerifyReport(False, count, *problem)
    if first is None:
        return VerifyReport(True, 0, None, "ok: the signed checkpoint states the range is empty")
    return VerifyReport(
        True,
        count,
        None,
        f"ok: events {first.seq}..{last_seq} intact, checkpoint signed at "
        f"{checkpoint.get('signed_at')} by {fingerprint}",
    )
