"""The export file formats (JSON Lines and CSV) and their parsing.

Every line of an export is written in exactly one canonical way; the verifier re-encodes what it
parsed and rejects a line that differs, so even edits that keep the parsed value (say, a hex
escape written in upper case) are caught.

An export holds, in this order: one ``tree`` line with what the Merkle tree needs beyond the
exported events (the compact range of the leaves before them, the perfect subtrees after them
up to the checkpoint's size, optionally a consistency proof from a size the auditor names); one
line per event; where the content of exported events was erased (crypto-shredded), one
``erased`` line naming them; one ``checkpoint`` line holding the signed C2SP checkpoint note.
The ``erased`` line is not signed: it is derived from the log's own ``erasure`` events (their
``key_refs`` against each event's ``commitment_key``), which an export of them confirms.

JSON Lines: one canonical JSON object per line with a ``record`` field (``event``, ``tree``,
``erased``, ``checkpoint``). CSV: a header row, one row per event with the payload as canonical
JSON, and ``tree``, ``erased`` and ``checkpoint`` rows whose ``payload`` cell holds that record
as canonical JSON. An
empty CSV ``actor`` or ``mac`` cell means none.
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

from gateway.audit.canonical import canonical_json, chain_hash, event_bytes
from gateway.audit.merkle import HASH_SIZE

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
    "mac",
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
    mac: str | None = None

    @property
    def leaf_index(self) -> int:
        return self.seq - 1

    def canonical_bytes(self) -> bytes:
        return event_bytes(
            seq=self.seq,
            event_id=self.event_id,
            created_at=self.created_at,
            kind=self.kind,
            actor=self.actor,
            payload=self.payload,
            prev_hash=self.prev_hash,
        )

    def computed_hash(self) -> str:
        return chain_hash(self.canonical_bytes())


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


def unb64_hash(text: Any) -> bytes:
    """A 32-byte hash from its canonical base64; RecordFormatError otherwise."""
    if not isinstance(text, str):
        raise RecordFormatError("a hash is not a base64 string")
    try:
        digest = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RecordFormatError("a hash is not valid base64") from None
    if len(digest) != HASH_SIZE or b64(digest) != text:
        raise RecordFormatError("a hash is not 32 bytes of canonical base64")
    return digest


@dataclass(frozen=True)
class TreeRecord:
    """The tree beyond the exported events: ``left`` is the compact range of leaves
    [0, start), ``right`` the perfect subtrees after the last exported leaf up to the
    checkpoint's size, ``consistency`` a proof from tree size ``consistency_from`` to it."""

    start: int
    left: tuple[bytes, ...]
    right: tuple[bytes, ...]
    consistency_from: int | None = None
    consistency: tuple[bytes, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "left": [b64(h) for h in self.left],
            "right": [b64(h) for h in self.right],
            "consistency_from": self.consistency_from,
            "consistency": [b64(h) for h in self.consistency],
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> TreeRecord:
        if set(value) != {"start", "left", "right", "consistency_from", "consistency"}:
            raise RecordFormatError("tree record fields are wrong")
        start, since = value["start"], value["consistency_from"]
        if not _is_size(start) or not (since is None or _is_size(since)):
            raise RecordFormatError("tree record sizes are not non-negative integers")
        hashes = {}
        for name in ("left", "right", "consistency"):
            if not isinstance(value[name], list):
                raise RecordFormatError(f"tree record {name!r} is not a list")
            hashes[name] = tuple(unb64_hash(h) for h in value[name])
        return cls(start, hashes["left"], hashes["right"], since, hashes["consistency"])


@dataclass(frozen=True)
class CheckpointRecord:
    note: str


@dataclass(frozen=True)
class ErasedRecord:
    """The exported events whose stored content was erased: its data key is destroyed."""

    event_ids: tuple[str, ...]


Record = EventRecord | TreeRecord | ErasedRecord | CheckpointRecord


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _csv_line(cells: list[str]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(cells)
    return buffer.getvalue()


def csv_header() -> str:
    return _csv_line(list(CSV_COLUMNS))


def _record_json(record: TreeRecord | ErasedRecord | CheckpointRecord) -> dict[str, Any]:
    if isinstance(record, TreeRecord):
        return record.as_json()
    if isinstance(record, ErasedRecord):
        return {"event_ids": list(record.event_ids)}
    return {"note": record.note}


_RECORD_KINDS = {
    EventRecord: "event",
    TreeRecord: "tree",
    ErasedRecord: "erased",
    CheckpointRecord: "checkpoint",
}


def encode_record(record: Record, fmt: ExportFormat) -> str:
    kind = _RECORD_KINDS[type(record)]
    if isinstance(record, EventRecord):
        if fmt == "jsonl":
            return canonical_json({"record": kind, **asdict(record)}) + "\n"
        return _csv_line(
            [
                kind,
                str(record.seq),
                record.event_id,
                record.created_at,
                record.kind,
                record.actor or "",
                canonical_json(record.payload),
                record.prev_hash,
                record.event_hash,
                record.mac or "",
            ]
        )
    fields = _record_json(record)
    if fmt == "jsonl":
        return canonical_json({"record": kind, **fields}) + "\n"
    return _csv_line([kind, "", "", "", "", "", canonical_json(fields), "", "", ""])


def detect_format(first_line: str) -> ExportFormat:
    return "csv" if first_line == csv_header() else "jsonl"


def decode_line(line: str, fmt: ExportFormat) -> Record:
    """Parse one line (with its trailing newline) of an export in ``fmt``."""
    if not line.endswith("\n"):
        raise RecordFormatError("line is not terminated (export cut short?)")
    record = _decode_jsonl(line) if fmt == "jsonl" else _decode_csv(line)
    if encode_record(record, fmt) != line:
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
    for name in ("actor", "mac"):
        value = getattr(record, name)
        if value is not None and not isinstance(value, str):
            raise RecordFormatError(f"event field {name!r} has the wrong type")
    return record


def _load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RecordFormatError(f"not valid JSON: {exc}") from exc


def _other_record(record_type: str | None, value: Any) -> Record:
    if not isinstance(value, dict):
        raise RecordFormatError(f"{record_type} record is not a JSON object")
    if record_type == "tree":
        return TreeRecord.from_json(value)
    if record_type == "checkpoint":
        if set(value) != {"note"} or not isinstance(value["note"], str):
            raise RecordFormatError("checkpoint record holds no note")
        return CheckpointRecord(value["note"])
    if record_type == "erased":
        ids = value.get("event_ids")
        if set(value) != {"event_ids"} or not isinstance(ids, list) or not ids:
            raise RecordFormatError("erased record holds no event ids")
        if not all(isinstance(event_id, str) for event_id in ids):
            raise RecordFormatError("erased record's event ids are not strings")
        return ErasedRecord(tuple(ids))
    raise RecordFormatError(f"unknown record type {record_type!r}")


def _decode_jsonl(line: str) -> Record:
    value = _load_json(line)
    if not isinstance(value, dict):
        raise RecordFormatError("line is not a JSON object")
    record_type = value.pop("record", None)
    if record_type == "event":
        return _event_from_fields(value)
    return _other_record(record_type, value)


def _decode_csv(line: str) -> Record:
    try:
        rows = list(csv.reader([line]))
    except csv.Error as exc:
        raise RecordFormatError(f"not a valid CSV row: {exc}") from exc
    if len(rows) != 1 or len(rows[0]) != len(CSV_COLUMNS):
        raise RecordFormatError(f"CSV row does not have the {len(CSV_COLUMNS)} columns")
    cells = dict(zip(CSV_COLUMNS, rows[0], strict=True))
    record_type = cells.pop("record")
    if record_type != "event":
        return _other_record(record_type, _load_json(cells["payload"]))
    if not cells["seq"].isdigit():
        raise RecordFormatError("seq is not a number")
    return _event_from_fields(
        {
            **cells,
            "seq": int(cells["seq"]),
            "actor": cells["actor"] or None,
            "mac": cells["mac"] or None,
            "payload": _load_json(cells["payload"]),
        }
    )
