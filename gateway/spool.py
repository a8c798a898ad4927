"""A durable outbox for audit events that must not be lost and must not be waited for.

Two kinds of event go through it:

- ``fallback`` events from the engine's worker thread (``enqueue``): the worker must never wait
  on the database, so the event is written to the spool file and a writer thread commits it;
- ``completion`` events whose direct commit failed or timed out (``keep``): the text has been
  generated (and perhaps streamed), so the record of it is kept on local disk and committed
  when the store returns. Where the request's content is stored, the entry carries it sealed
  (encrypted under the subject's data key before it reaches the disk); the content row and
  the event are committed in one transaction, as a direct commit would have.

The spool is one JSON-lines file in the data directory: an ``add`` line per event and a ``done``
line once it is committed, each fsynced before the call returns. The writer commits pending
events strictly in spool order, retrying every ``retry_s`` until the store takes them; the
committed payload carries ``spool: {id, spooled_at, delay_s}`` so an auditor sees the delay.

A ``keep`` for a direct attempt that merely timed out may race that attempt: the writer waits
for the attempt to settle and drops the entry if it committed. After a crash the attempt's fate
is unknown, so on load the log is searched for the event (by spool id, or for a completion by
its request's event id) before it is committed again: an event is committed once. An entry
with sealed content counts as committed when its content row exists (the row and the event
commit together), also when the direct attempt's answer was lost after its COMMIT.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import structlog

from gateway.audit.canonical import format_timestamp
from gateway.audit.log import AppendedEvent, AuditLog, AuditUnavailableError
from gateway.audit.schema import audit_events
from gateway.privacy.store import SealedContent, append_with_content, content_stored

log = structlog.get_logger(__name__)

SPOOL_FILE = "audit-spool.jsonl"
# How far before a spooled event's first attempt its committed copy may be stamped (clock steps).
_SEARCH_MARGIN = timedelta(minutes=5)


@dataclass
class SpoolEntry:
    spool_id: str
    kind: str
    actor: str | None
    payload: dict[str, Any]
    spooled_at: datetime
    attempted_at: datetime | None
    content: SealedContent | None = None
    # The direct commit this entry backs up, while it may still complete in this process.
    attempt: Future[AppendedEvent] | None = field(default=None, repr=False)

    def line(self) -> dict[str, Any]:
        return {
            "op": "add",
            "id": self.spool_id,
            "kind": self.kind,
            "actor": self.actor,
            "payload": self.payload,
            "spooled_at": format_timestamp(self.spooled_at),
            "attempted_at": format_timestamp(self.attempted_at) if self.attempted_at else None,
            "content": self.content.as_json() if self.content else None,
        }


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


class EventSpool:
    def __init__(self, directory: Path, audit: AuditLog, db: sa.Engine, retry_s: float) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / SPOOL_FILE
        self._audit = audit
        self._db = db
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: deque[SpoolEntry] = deque(self._load())
        self._unchecked = {entry.spool_id for entry in self._pending}
        self._closing = False
        self._writer: threading.Thread | None = None

    # -- writing the file ---------------------------------------------------------------

    def _load(self) -> Iterator[SpoolEntry]:
        if not self.path.exists():
            return
        added: dict[str, SpoolEntry] = {}
        with self.path.open(encoding="utf-8") as lines:
            for text in lines:
                try:
                    line = json.loads(text)
                except json.JSONDecodeError:
                    continue  # a line torn by a crash mid-write was never acknowledged
                if line.get("op") == "add":
                    added[line["id"]] = SpoolEntry(
                        line["id"],
                        line["kind"],
                        line["actor"],
                        line["payload"],
                        _parse_time(line["spooled_at"]),
                        _parse_time(line["attempted_at"]) if line.get("attempted_at") else None,
                        SealedContent.from_json(line["content"]) if line.get("content") else None,
                    )
                elif line.get("op") == "done":
                    added.pop(line["id"], None)
        yield from added.values()

    def _write(self, line: dict[str, Any]) -> None:
        """Append one line and fsync it; the caller holds the lock."""
        with self.path.open("a", encoding="utf-8") as spool:
            spool.write(json.dumps(line, separators=(",", ":"), ensure_ascii=False) + "\n")
            spool.flush()
            os.fsync(spool.fileno())

    def _add(self, entry: SpoolEntry) -> None:
        with self._lock:
            self._write(entry.line())
            self._pending.append(entry)
            self._wake.notify_all()

    def enqueue(self, kind: str, actor: str | None, payload: dict[str, Any]) -> None:
        """Keep an event for the writer to commit; returns once it is on disk (never waits on
        the database). Safe from any thread."""
        self._add(
            SpoolEntry(uuid.uuid4().hex, kind, actor, payload, datetime.now(UTC), attempted_at=None)
        )

    def keep(
        self,
        kind: str,
        actor: str | None,
        payload: dict[str, Any],
        attempt: Future[AppendedEvent],
        attempted_at: datetime,
        content: SealedContent | None = None,
    ) -> None:
        """Back up a direct commit (``commit``) that failed or did not finish in time, with
        the sealed content it stores; returns once the entry is on disk. Raises OSError when
        it cannot be written."""
        entry = SpoolEntry(
            uuid.uuid4().hex,
            kind,
            actor,
            payload,
            datetime.now(UTC),
            attempted_at,
            content,
            attempt,
        )
        self._add(entry)

    def commit(
        self,
        kind: str,
        actor: str | None,
        payload: dict[str, Any],
        content: SealedContent | None = None,
    ) -> AppendedEvent:
        """Commit an event now, with its sealed content in the same transaction: the direct
        attempt that ``keep`` backs up, and the writer's commit of a spooled entry."""
        if content is None:
            return self._audit.append(kind, actor, payload)
        return append_with_content(self._db, self._audit, kind, actor, payload, content)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    # -- the writer -----------------------------------------------------------------------

    def start(self) -> None:
        self._writer = threading.Thread(target=self._run, name="specgate-spool", daemon=True)
        self._writer.start()

    def close(self, timeout_s: float) -> None:
        """Let the writer commit what it can within ``timeout_s``; the rest stays on disk."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._pending and self._writer is not None and time.monotonic() < deadline:
                self._wake.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            self._closing = True
            self._wake.notify_all()
        if self._writer is not None:
            self._writer.join(timeout=max(0.0, deadline - time.monotonic()) + 0.1)

    def drain(self) -> None:
        """Commit every pending event now (startup, before the `startup` event); raises
        AuditUnavailableError when the store refuses."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                entry = self._pending[0]
            self._commit(entry)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
                entry = self._pending[0]
            try:
                self._commit(entry)
            except AuditUnavailableError as error:
                log.warning("spooled_event_not_committed", kind=entry.kind, error=str(error))
                with self._lock:
                    self._wake.wait(self._retry_s)
            except Exception:
                log.exception("spooled_event_not_committed", kind=entry.kind)
                with self._lock:
                    self._wake.wait(self._retry_s)

    def _commit(self, entry: SpoolEntry) -> None:
        """Commit the head entry (unless it is already in the log), then mark it done."""
        if entry.attempt is not None:
            try:
                entry.attempt.result(timeout=self._retry_s)
            except TimeoutError:
                raise AuditUnavailableError("the direct commit is still waiting") from None
            except Exception:
                entry.attempt = None  # it failed: the spooled copy is the record
            else:
                self._done(entry)  # it committed after all: nothing to add
                return
        if entry.content is not None and content_stored(self._db, entry.content.content_id):
            self._done(entry)  # committed with its content, though no answer said so
            return
        if entry.spool_id in self._unchecked:
            if self._already_committed(entry):
                self._done(entry)
                return
            self._unchecked.discard(entry.spool_id)
        now = datetime.now(UTC)
        spool = {
            "id": entry.spool_id,
            "spooled_at": format_timestamp(entry.spooled_at),
            "delay_s": round((now - entry.spooled_at).total_seconds(), 6),
        }
        self.commit(entry.kind, entry.actor, {**entry.payload, "spool": spool}, entry.content)
        self._done(entry)

    def _done(self, entry: SpoolEntry) -> None:
        with self._lock:
            self._write({"op": "done", "id": entry.spool_id})
            if self._pending and self._pending[0] is entry:
                self._pending.popleft()
            if not self._pending:
                self.path.write_text("", encoding="utf-8")  # all committed: start afresh
            self._wake.notify_all()

    def _already_committed(self, entry: SpoolEntry) -> bool:
        """Whether a previous process committed this event (by spool id, or a completion for
        the same request) before it could mark it done."""
        since = (entry.attempted_at or entry.spooled_at) - _SEARCH_MARGIN
        query = (
            sa.select(audit_events.c.payload)
            .where(audit_events.c.kind == entry.kind, audit_events.c.created_at >= since)
            .order_by(audit_events.c.seq)
        )
        request_event_id = entry.payload.get("request_event_id")
        try:
            with self._db.connect() as connection:
                for (payload,) in connection.execution_options(yield_per=500).execute(query):
                    if (payload.get("spool") or {}).get("id") == entry.spool_id:
                        return True
                    if request_event_id is not None and (
                        payload.get("request_event_id") == request_event_id
                    ):
                        return True
        except sa.exc.SQLAlchemyError as error:
            raise AuditUnavailableError(f"audit store unavailable: {error}") from error
        return False
