"""What the gateway states about its own log, for a witness (``GET /v1/audit/status``): its
tamper alarm, the tree size, the newest checkpoint it serves, and when the oldest event that
no checkpoint covers yet was written. The times are the gateway's own, ``now`` included, so
that the witness measures ages on one clock and needs no synchronised clocks."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError

from gateway.audit.canonical import format_timestamp
from gateway.audit.log import AuditLog, AuditUnavailableError, TamperDetectedError
from gateway.audit.note import NoteError, verify_checkpoint
from gateway.audit.schema import audit_events
from gateway.audit.signing import CheckpointSigner

# As many as AuditLog.latest_checkpoint looks at, so both find the same checkpoint.
CHECKPOINTS_SCANNED = 20


@dataclass(frozen=True)
class NewestCheckpoint:
    size: int
    signed_at: str | None


def log_status(audit: AuditLog, db: sa.Engine) -> dict[str, Any]:
    """The status document; raises AuditUnavailableError when the store cannot be read."""
    tree_size, _ = audit.head()
    try:
        with db.connect() as connection:
            newest = newest_checkpoint(connection, audit.signer)
            waiting_since = oldest_uncovered_event(connection, newest.size if newest else 0)
    except SQLAlchemyError as exc:
        raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
    return {
        "tamper": _alarm(audit.tamper),
        "tree_size": tree_size,
        "newest_checkpoint_size": newest.size if newest else None,
        "newest_checkpoint_signed_at": newest.signed_at if newest else None,
        "oldest_uncovered_event_at": waiting_since,
        "now": format_timestamp(datetime.now(UTC)),
    }


def _alarm(tamper: TamperDetectedError | None) -> dict[str, Any] | None:
    if tamper is None:
        return None
    return {"first_bad_seq": tamper.first_bad_seq, "reason": tamper.reason}


def newest_checkpoint(
    connection: sa.Connection, signer: CheckpointSigner
) -> NewestCheckpoint | None:
    """The newest checkpoint event whose note this gateway's key signed (the one
    ``GET /v1/audit/checkpoint`` serves), or None before the first."""
    query = (
        sa.select(audit_events.c.payload)
        .where(audit_events.c.kind == "checkpoint")
        .order_by(audit_events.c.seq.desc())
        .limit(CHECKPOINTS_SCANNED)
    )
    for (payload,) in connection.execute(query):
        note = payload.get("note") if isinstance(payload, dict) else None
        if not isinstance(note, str):
            continue
        try:
            checkpoint = verify_checkpoint(note, signer.public_key, signer.origin)
        except NoteError:
            continue
        signed_at = payload.get("signed_at")
        return NewestCheckpoint(checkpoint.size, signed_at if isinstance(signed_at, str) else None)
    return None


def oldest_uncovered_event(connection: sa.Connection, covered: int) -> str | None:
    """When the first event after the ``covered`` tree was written. Checkpoint events are
    left out: one records a signature, not something waiting to be witnessed, and after a
    restart the previous run's final checkpoint event waits for the new run's first
    checkpoint however long the gateway was down."""
    query = (
        sa.select(audit_events.c.created_at)
        .where(audit_events.c.seq > covered, audit_events.c.kind != "checkpoint")
        .order_by(audit_events.c.seq)
        .limit(1)
    )
    created_at = connection.execute(query).scalar()
    return format_timestamp(created_at) if created_at is not None else None
