"""The audit log: appends hash-chained events, signs checkpoints, exports and verifies ranges.

Appends are serialised by the database (``pg_advisory_xact_lock`` inside the inserting
transaction on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), so any number of writers, in any
number of processes, extend one chain and never fork it. Within a process, concurrent appends
are group-committed: whichever caller finds no write in progress becomes the writer and commits
everything queued so far in one transaction, so one commit (one fsync) serves many events.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError

from gateway.audit.canonical import GENESIS_HASH, event_hash, format_timestamp, normalise_payload
from gateway.audit.records import (
    EXPORT_FORMATS,
    EventRecord,
    ExportFormat,
    csv_header,
    encode_checkpoint,
    encode_event,
    export_checkpoint_statement,
)
from gateway.audit.schema import audit_events
from gateway.audit.signing import CheckpointSigner
from gateway.audit.verify import VerifyReport, verify_export
from gateway.db import write_connection

# Key of the PostgreSQL advisory lock that serialises appends (any constant shared by writers).
AUDIT_LOCK_KEY = int.from_bytes(b"sgaudit!", "big")
MAX_BATCH = 256
_KIND = re.compile(r"[a-z][a-z_]{0,31}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class AuditUnavailableError(Exception):
    """The audit store could not record or read events; callers must fail closed."""


@dataclass(frozen=True)
class AppendedEvent:
    seq: int
    event_id: str
    event_hash: str
    created_at: datetime


@dataclass
class _Pending:
    """One queued append. ``wake`` is set when it is done, or when its caller is to take over
    as the writer."""

    kind: str
    actor: str | None
    payload: dict[str, Any]
    wake: threading.Event = field(default_factory=threading.Event, repr=False)
    done: bool = False
    result: AppendedEvent | None = None
    error: BaseException | None = field(default=None, repr=False)


def _checked_event(kind: str, actor: str | None) -> tuple[str, str | None]:
    if not _KIND.fullmatch(kind):
        raise ValueError(f"invalid audit event kind {kind!r}")
    if actor is not None and (len(actor) > 200 or _CONTROL.search(actor)):
        raise ValueError("an audit actor is at most 200 characters, without control characters")
    return kind, actor or None


def insert_events(
    connection: sa.Connection, events: Sequence[tuple[str, str | None, dict[str, Any]]]
) -> list[AppendedEvent]:
    """Append ``(kind, actor, normalised payload)`` events inside ``connection``'s open
    transaction (from ``gateway.db.write_connection``); they become visible at its commit."""
    if connection.dialect.name == "postgresql":
        connection.execute(sa.select(sa.func.pg_advisory_xact_lock(AUDIT_LOCK_KEY)))
    head = connection.execute(
        sa.select(audit_events.c.seq, audit_events.c.event_hash)
        .order_by(audit_events.c.seq.desc())
        .limit(1)
    ).first()
    seq, prev_hash = (head.seq, head.event_hash) if head else (0, GENESIS_HASH)
    rows: list[dict[str, Any]] = []
    appended: list[AppendedEvent] = []
    for kind, actor, payload in events:
        seq += 1
        event_id = str(uuid.uuid4())
        created_at = datetime.now(UTC)
        fields: dict[str, Any] = {
            "seq": seq,
            "event_id": event_id,
            "kind": kind,
            "actor": actor,
            "payload": payload,
            "prev_hash": prev_hash,
        }
        digest = event_hash(**fields, created_at=format_timestamp(created_at))
        rows.append({**fields, "created_at": created_at, "event_hash": digest})
        appended.append(AppendedEvent(seq, event_id, digest, created_at))
        prev_hash = digest
    connection.execute(sa.insert(audit_events), rows)
    return appended


def _record_from_row(row: sa.Row[Any]) -> EventRecord:
    return EventRecord(
        seq=row.seq,
        event_id=row.event_id,
        created_at=format_timestamp(row.created_at),
        kind=row.kind,
        actor=row.actor,
        payload=row.payload,
        prev_hash=row.prev_hash,
        event_hash=row.event_hash,
    )


def _utc(moment: datetime | None) -> datetime | None:
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


class AuditLog:
    def __init__(self, db: sa.Engine, signer: CheckpointSigner | None = None) -> None:
        """``signer`` may be left out by tools that only append (the key CLI); checkpoints,
        exports and verification need it."""
        self._db = db
        self._signer = signer
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._writing = False

    @property
    def signer(self) -> CheckpointSigner:
        if self._signer is None:
            raise RuntimeError("this AuditLog has no signing key")
        return self._signer

    def append(self, kind: str, actor: str | None, payload: dict[str, Any]) -> AppendedEvent:
        """Record one event and return once it is committed."""
        kind, actor = _checked_event(kind, actor)
        pending = _Pending(kind, actor, normalise_payload(payload))
        with self._lock:
            self._queue.append(pending)
            leading = not self._writing
            self._writing = True
        if not leading:
            pending.wake.wait()
        if not pending.done:
            self._lead(pending)
        if isinstance(pending.error, SQLAlchemyError):
            raise AuditUnavailableError(f"audit store unavailable: {pending.error}") from (
                pending.error
            )
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    def append_in(
        self, connection: sa.Connection, kind: str, actor: str | None, payload: dict[str, Any]
    ) -> AppendedEvent:
        """Record one event inside the caller's open write transaction (from
        ``gateway.db.write_connection``), so that it commits or rolls back with the caller's
        own change."""
        kind, actor = _checked_event(kind, actor)
        (appended,) = insert_events(connection, [(kind, actor, normalise_payload(payload))])
        return appended

    def _lead(self, own: _Pending) -> None:
        """Write queued batches until ``own`` is written, then hand the writer's role to the
        first caller still waiting, if any (waking only that one)."""
        while True:
            with self._lock:
                batch = self._queue[:MAX_BATCH]
                del self._queue[:MAX_BATCH]
            self._write(batch)
            with self._lock:
                if not self._queue:
                    self._writing = False
                    return
                if own.done:
                    self._queue[0].wake.set()
                    return

    def _write(self, batch: list[_Pending]) -> None:
        """Commit ``batch`` in one transaction; hand each caller its result or the error."""
        try:
            with write_connection(self._db) as connection, connection.begin():
                results = insert_events(connection, [(p.kind, p.actor, p.payload) for p in batch])
        except BaseException as exc:  # every waiting caller must wake, whatever happened
            for pending in batch:
                pending.error = exc
        else:
            for pending, result in zip(batch, results, strict=True):
                pending.result = result
        for pending in batch:
            pending.done = True
            pending.wake.set()

    def ping(self) -> bool:
        try:
            with self._db.connect() as connection:
                connection.execute(sa.select(audit_events.c.seq).limit(1))
        except SQLAlchemyError:
            return False
        return True

    def head(self) -> tuple[int, str]:
        """(seq, event_hash) of the newest event; (0, 64 zeros) while the log is empty."""
        try:
            with self._db.connect() as connection:
                row = connection.execute(
                    sa.select(audit_events.c.seq, audit_events.c.event_hash)
                    .order_by(audit_events.c.seq.desc())
                    .limit(1)
                ).first()
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
        return (row.seq, row.event_hash) if row else (0, GENESIS_HASH)

    def checkpoint(self) -> dict[str, Any]:
        """Sign the current chain head and record the signed statement as a ``checkpoint``
        event. Returns the signed checkpoint."""
        seq, head_hash = self.head()
        signed = self.signer.sign(
            {
                "seq": seq,
                "head_hash": head_hash,
                "signed_at": format_timestamp(datetime.now(UTC)),
            }
        )
        self.append("checkpoint", "specgate", signed)
        return signed

    def _seq_range(
        self, since: datetime | None, until: datetime | None
    ) -> tuple[int | None, int | None]:
        """First and last seq of events created in [since, until). Appends take their time
        under the chain lock, so the range is one contiguous stretch of the chain."""
        created = audit_events.c.created_at
        seq = audit_events.c.seq
        first = sa.select(sa.func.min(seq))
        last = sa.select(sa.func.max(seq))
        if since is not None:
            first = first.where(created >= since)
            last = last.where(created >= since)
        if until is not None:
            first = first.where(created < until)
            last = last.where(created < until)
        try:
            with self._db.connect() as connection:
                return connection.execute(first).scalar(), connection.execute(last).scalar()
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc

    def export(
        self,
        since: datetime | None,
        until: datetime | None,
        fmt: ExportFormat = "jsonl",
        actor: str | None = None,
    ) -> Iterator[str]:
        """Lines of an export of the events created in [since, until), ending in a checkpoint
        signed over the first exported event's prev_hash and the last one's seq and hash. The
        export itself is recorded (an ``export`` event) before any line is produced."""
        if fmt not in EXPORT_FORMATS:
            raise ValueError(f"unknown export format {fmt!r}; use one of {EXPORT_FORMATS}")
        since, until = _utc(since), _utc(until)
        first_seq, last_seq = self._seq_range(since, until)
        self.append(
            "export",
            actor,
            {
                "since": format_timestamp(since) if since else None,
                "until": format_timestamp(until) if until else None,
                "format": fmt,
                "first_seq": first_seq,
                "last_seq": last_seq,
            },
        )
        return self._export_lines(first_seq, last_seq, since, until, fmt)

    def _export_lines(
        self,
        first_seq: int | None,
        last_seq: int | None,
        since: datetime | None,
        until: datetime | None,
        fmt: ExportFormat,
    ) -> Iterator[str]:
        if fmt == "csv":
            yield csv_header()
        first: EventRecord | None = None
        last: EventRecord | None = None
        count = 0
        if first_seq is not None and last_seq is not None:
            query = (
                sa.select(audit_events)
                .where(audit_events.c.seq.between(first_seq, last_seq))
                .order_by(audit_events.c.seq)
            )
            try:
                with self._db.connect() as connection:
                    for row in connection.execution_options(yield_per=1000).execute(query):
                        last = _record_from_row(row)
                        first = first or last
                        count += 1
                        yield encode_event(last, fmt)
            except SQLAlchemyError as exc:
                raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
        signed = self.signer.sign(
            export_checkpoint_statement(
                first,
                last,
                count,
                format_timestamp(since) if since else None,
                format_timestamp(until) if until else None,
                format_timestamp(datetime.now(UTC)),
            )
        )
        yield encode_checkpoint(signed, fmt)

    def verify(self, since: datetime | None = None, until: datetime | None = None) -> VerifyReport:
        """The offline check (``verify_export``) run on the server over the events created in
        [since, until), as the database holds them now."""
        since, until = _utc(since), _utc(until)
        first_seq, last_seq = self._seq_range(since, until)
        lines = self._export_lines(first_seq, last_seq, since, until, "jsonl")
        return verify_export(lines, self.signer.public_key_pem())
