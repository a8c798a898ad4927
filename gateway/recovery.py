"""Startup after a crash: mark the requests the previous run of this instance left unanswered.

Every `request` event carries the ``instance_id`` of the gateway that served it (configured,
or kept in the data directory, so that it survives restarts); every `startup` event carries it
too. On startup the gateway reads the log from its own previous `startup` onwards, and for
each of its `request` events with neither a `completion` nor an `interrupted` event appends an
`interrupted` event that references it. Nothing is rewritten; other instances' requests (which
may still be in flight) are left alone.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import sqlalchemy as sa

from gateway.audit.log import AuditLog, AuditUnavailableError
from gateway.audit.schema import audit_events
from gateway.db import write_connection

INSTANCE_ID_FILE = "instance-id"


def instance_id(data_dir: Path, configured: str | None = None) -> str:
    """This gateway's stable id: the configured one (``SPECGATE_INSTANCE_ID``), which a
    replica keeps across restarts even without a persistent data directory; else one created
    once in the data directory."""
    if configured is not None:
        return configured
    path = data_dir / INSTANCE_ID_FILE
    if path.is_file():
        text = path.read_text(encoding="utf-8").strip()
        if text:
            return text
    data_dir.mkdir(parents=True, exist_ok=True)
    new = uuid.uuid4().hex
    path.write_text(new + "\n", encoding="utf-8")
    return new


def _previous_startup_seq(connection: sa.Connection, instance: str) -> int | None:
    query = (
        sa.select(audit_events.c.seq, audit_events.c.payload)
        .where(audit_events.c.kind == "startup")
        .order_by(audit_events.c.seq.desc())
    )
    for seq, payload in connection.execute(query.execution_options(yield_per=100)):
        if payload.get("instance_id") == instance:
            return int(seq)
    return None


def unanswered_requests(
    connection: sa.Connection, instance: str
) -> list[tuple[str, dict[str, object]]]:
    """(event id, payload) of this instance's `request` events since its previous `startup`
    that have no `completion` or `interrupted` event, oldest first."""
    since = _previous_startup_seq(connection, instance)
    if since is None:
        return []
    query = (
        sa.select(audit_events.c.event_id, audit_events.c.kind, audit_events.c.payload)
        .where(
            audit_events.c.seq > since,
            audit_events.c.kind.in_(("request", "completion", "interrupted")),
        )
        .order_by(audit_events.c.seq)
    )
    open_requests: dict[str, dict[str, object]] = {}
    for event_id, kind, payload in connection.execute(query.execution_options(yield_per=1000)):
        if kind == "request":
            if payload.get("instance_id") == instance:
                open_requests[event_id] = payload
        else:
            open_requests.pop(str(payload.get("request_event_id")), None)
    return list(open_requests.items())


def mark_interrupted_in(
    audit: AuditLog, connection: sa.Connection, instance: str, reason: str, marked_by: str
) -> int:
    """Inside the caller's write transaction, append an `interrupted` event for each of
    ``instance``'s unanswered requests; returns how many. Callers serialise on the
    instance's lease row (``gateway.leases``), so two gateways never mark one request twice."""
    unanswered = unanswered_requests(connection, instance)
    for event_id, payload in unanswered:
        audit.append_in(
            connection,
            "interrupted",
            "specgate",
            {
                "request_event_id": event_id,
                "request_id": payload.get("request_id"),
                "instance_id": instance,
                "marked_by": marked_by,
                "reason": reason,
            },
        )
    return len(unanswered)


RESTART_REASON = "the gateway stopped before the request was answered"


def mark_interrupted(audit: AuditLog, db: sa.Engine, instance: str) -> int:
    """Append an `interrupted` event for each of this instance's unanswered requests (one
    transaction); returns how many."""
    try:
        with write_connection(db) as connection, connection.begin():
            return mark_interrupted_in(audit, connection, instance, RESTART_REASON, instance)
    except sa.exc.SQLAlchemyError as error:
        raise AuditUnavailableError(f"audit store unavailable: {error}") from error
