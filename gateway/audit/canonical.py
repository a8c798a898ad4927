"""The canonical serialisation that event hashes and checkpoint signatures are computed over.

Canonical JSON here is ``json.dumps(value, sort_keys=True, separators=(",", ":"),
ensure_ascii=False, allow_nan=False)`` encoded as UTF-8: keys sorted, no whitespace, non-ASCII
characters written as themselves, NaN and infinities refused.

An event's hash is the SHA-256 (lower-case hex) of the canonical JSON of the object
``{"seq", "event_id", "created_at", "kind", "actor", "payload", "prev_hash"}``, where
``created_at`` is the UTC time in ISO 8601 with microseconds (``2026-01-31T12:00:00.000000+00:00``)
and ``prev_hash`` is the previous event's hash (64 zeros for the first event).

The same bytes are the event's Merkle leaf (``merkle.leaf_hash``, RFC 9162) and what its MAC
(``mac.EventMac``) authenticates.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

GENESIS_HASH = "0" * 64


def canonical_json(value: Any) -> str:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def normalise_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload as it reads back from JSON storage (e.g. tuples become lists), so that the
    hash computed at append time recomputes from the stored row."""
    if not isinstance(payload, dict):
        raise ValueError("an audit payload must be a JSON object")
    try:
        normalised: dict[str, Any] = json.loads(canonical_json(payload))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"audit payload is not serialisable as canonical JSON: {exc}") from exc
    return normalised


def format_timestamp(moment: datetime) -> str:
    """UTC ISO 8601 with microseconds; naive datetimes (SQLite reads them back so) are UTC."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


def event_bytes(
    *,
    seq: int,
    event_id: str,
    created_at: str,
    kind: str,
    actor: str | None,
    payload: dict[str, Any],
    prev_hash: str,
) -> bytes:
    """The canonical bytes of an event: what its chain hash, its Merkle leaf hash and its MAC
    are computed over."""
    body = {
        "seq": seq,
        "event_id": event_id,
        "created_at": created_at,
        "kind": kind,
        "actor": actor,
        "payload": payload,
        "prev_hash": prev_hash,
    }
    return canonical_json(body).encode("utf-8")


def event_hash(
    *,
    seq: int,
    event_id: str,
    created_at: str,
    kind: str,
    actor: str | None,
    payload: dict[str, Any],
    prev_hash: str,
) -> str:
    return chain_hash(
        event_bytes(
            seq=seq,
            event_id=event_id,
            created_at=created_at,
            kind=kind,
            actor=actor,
            payload=payload,
            prev_hash=prev_hash,
        )
    )


def chain_hash(canonical: bytes) -> str:
    """The chain's ``event_hash`` of an event's canonical bytes (hex SHA-256)."""
    return hashlib.sha256(canonical).hexdigest()
