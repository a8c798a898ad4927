"""The export file formats (JSON Lines and CSV) and their parsing.

Every line of an export is written in exactly one canonical way; the verifier re-encodes what it
parsed and rejects a line that differs, so even edits that keep the parsed value (say, a hex
escape written in upper case) are caught.

JSON Lines: one canonical JSON object per line, ``{"record": "event", ...fields}`` for events and
a final ``{"record": "checkpoint", ...}`` line. CSV: a header row, one row per event with the
payload as canonical JSON, and a final row whose ``record`` is ``checkpoint`` and whose
``payload`` holds the checkpoint as canonical JSON. An empty CSV ``actor`` cell means none.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

from gateway.audit.canonical import canonical_json, event_hash

ExportFormat = Literal["jsonl", "csv"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = ("jsonl", "csv")
CSV_COLUMNS = (
    "record",
    "seq",
    "event_id",
    "created_at",
    "kind",
    "actor",
    "payload",
    "prev_hash",
    "event_hash",
)


class RecordFormatError(ValueError):
    """A line of an export that cannot be read, or is not written in the canonical form."""


@dataclass(frozen=True)
class EventRecord:
    seq: int
    event_id: str
    created_at: str
    kind: str
    actor: str | None
    payload: dict[str, Any]
    prev_hash: str
    event_hash: str

    def computed_hash(self) -> str:
        return event_hash(
            seq=self.seq,
            event_id=self.event_id,
            created_at=self.created_at,
            kind=self.kind,
            actor=self.actor,
            payload=self.payload,
            prev_hash=self.prev_hash,
        )


Record = EventRecord | dict[str, Any]  # an event, or a signed checkpoint


def export_checkpoint_statement(
    first: EventRecord | None,
    last: EventRecord | None,
    event_count: int,
    since: str | None,
    until: str | None,
    signed_at: str,
) -> dict[str, Any]:
    """What the checkpoint closing an export states (and signs): the exported range's first
    event and the hash it chains onto, its last event's seq and hash, and how many events."""
    return {
        "seq": last.seq if last else None,
        "head_hash": last.event_hash if last else None,
        "first_seq": first.seq if first else None,
        "first_prev_hash": first.prev_hash if first else None,
        "event_count": event_count,
        "since": since,
        "until": until,
        "signed_at": signed_at,
    }


def _csv_line(cells: list[str]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(cells)
    return buffer.getvalue()


def csv_header() -> str:
    return _csv_line(list(CSV_COLUMNS))


def encode_event(record: EventRecord, fmt: ExportFormat) -> str:
    if fmt == "jsonl":
        return canonical_json({"record": "event", **asdict(record)}) + "\n"
    return _csv_line(
        [
            "event",
            str(record.seq),
            record.event_id,
            record.created_at,
            record.kind,
            record.actor or "",
            canonical_json(record.payload),
            record.prev_hash,
            record.event_hash,
        ]
    )


def encode_checkpoint(checkpoint: dict[str, Any], fmt: ExportFormat) -> str:
    if fmt == "jsonl":
        return canonical_json({"record": "checkpoint", **checkpoint}) + "\n"
    return _csv_line(["checkpoint", "", "", "", "", "", canonical_json(checkpoint), "", ""])


def detect_format(first_line: str) -> ExportFormat:
    return "csv" if first_line == csv_header() else "jsonl"


def decode_line(line: str, fmt: ExportFormat) -> Record:
    """Parse one line (with its trailing newline) of an export in ``fmt``."""
    if not line.endswith("\n"):
        raise RecordFormatError("line is not terminated (export cut short?)")
    record = _decode_jsonl(line) if fmt == "jsonl" else _decode_csv(line)
    encoded = (
        encode_event(record, fmt)
        if isinstance(record, EventRecord)
        else encode_checkpoint(record, fmt)
    )
    if encoded != line:
        raise RecordFormatError("line is not in the canonical form it was exported in")
    return record


def _event_from_fields(fields: dict[str, Any]) -> EventRecord:
    try:
        record = EventRecord(**fields)
    except TypeError as exc:
        raise RecordFormatError(f"event fields are wrong: {exc}") from exc
    expected_types = {
        "seq": int,
        "event_id": str,
        "created_at": str,
        "kind": str,
        "payload": dict,
        "prev_hash": str,
        "event_hash": str,
    }
    for name, expected in expected_types.items():
        value = getattr(record, name)
        if not isinstance(value, expected) or isinstance(value, bool):
            raise RecordFormatError(f"event field {name!r} has the wrong type")
    if record.actor is not None and not isinstance(record.actor, str):
        raise RecordFormatError("event field 'actor' has the wrong type")
    return record


def _load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RecordFormatError(f"not valid JSON: {exc}") from exc


def _decode_jsonl(line: str) -> Record:
    value = _load_json(line)
    if not isinstance(value, dict):
        raise RecordFormatError("line is not a JSON object")
    record_type = value.pop("record", None)
    if record_type == "event":
        return _event_from_fields(value)
    if record_type == "checkpoint":
        return value
    raise RecordFormatError(f"unknown record type {record_type!r}")


def _decode_csv(line: str) -> Record:
    try:
        rows = list(csv.reader([line]))
    except csv.Error as exc:
        raise RecordFormatError(f"not a valid CSV row: {exc}") from exc
    if len(rows) != 1 or len(rows[0]) != len(CSV_COLUMNS):
        raise RecordFormatError(f"CSV row does not have the {len(CSV_COLUMNS)} columns")
    cells = dict(zip(CSV_COLUMNS, rows[0], strict=True))
    record_type = cells.pop("record")
    if record_type == "checkpoint":
        checkpoint = _load_json(cells["payload"])
        if not isinstance(checkpoint, dict):
            raise RecordFormatError("checkpoint is not a JSON object")
        return checkpoint
    if record_type != "event":
        raise RecordFormatError(f"unknown record type {record_type!r}")
    if not cells["seq"].isdigit():
        raise RecordFormatError("seq is not a number")
    return _event_from_fields(
        {
            **cells,
            "seq": int(cells["seq"]),
            "actor": cells["actor"] or None,
            "payload": _load_json(cells["payload"]),
        }
    )
