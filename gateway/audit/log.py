"""The audit log: appends MAC'd, hash-chained events to a Merkle tree, signs checkpoints over
its root once it has checked that the database still extends the last one it signed, and
serves exports and proofs.

Appends are serialised by the database: a row lock on the single ``audit_head`` row, taken
with ``SELECT ... FOR UPDATE`` under ``lock_timeout`` (PostgreSQL; it needs UPDATE on that row,
which only the writer role has), ``BEGIN IMMEDIATE`` on SQLite. So any number of writers, in
any number of processes, extend one tree and never fork it, and a stuck lock is a 503 in
bounded time. Within a process, concurrent appends are group-committed: whichever caller finds
no write in progress becomes the writer and commits everything queued so far in one
transaction, so one commit (one fsync) serves many events.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy.exc import SQLAlchemyError

from gateway.audit.canonical import event_bytes, format_timestamp, normalise_payload
from gateway.audit.known_head import KnownHead, append_at, append_params
from gateway.audit.legacy import LEGACY_KIND, LegacyPrefix, declaration_payload
from gateway.audit.mac import EventMac
from gateway.audit.merkle import (
    CompactRange,
    Node,
    aligned_pieces,
    consistency_proof_ranges,
    inclusion_proof_ranges,
    leaf_hash,
    nodes_for,
    perfect_pieces,
    range_hash,
)
from gateway.audit.note import NoteError, cosignature_time, parse_checkpoint, verify_checkpoint
from gateway.audit.records import (
    EXPORT_FORMATS,
    CheckpointRecord,
    ErasedRecord,
    EventRecord,
    ExportFormat,
    TreeRecord,
    b64,
    csv_header,
    encode_record,
)
from gateway.audit.schema import audit_events, audit_head, audit_merkle_nodes
from gateway.audit.signing import CheckpointSigner
from gateway.audit.state import (
    Alarm,
    Anchor,
    SignedState,
    beside,
    load_alarm,
    load_anchor,
    load_state,
    save_alarm,
    save_anchor,
    save_state,
)
from gateway.audit.sweep import Sweep
from gateway.audit.verify import VerifyReport, event_problem, verify_export
from gateway.db import (
    execute_first,
    is_sqlite,
    once_more_if_ended,
    read_connection,
    write_connection,
)

log = structlog.get_logger(__name__)

MAX_BATCH = 256
# The event kind that records destroyed data keys (``gateway.privacy.store``); exports mark
# the events whose content they erased.
ERASURE_KIND = "erasure"
APPEND_LOCK_TIMEOUT_S = 5.0
_KIND = re.compile(r"[a-z][a-z_]{0,31}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class AuditUnavailableError(Exception):
    """The audit store could not record or read events; callers must fail closed."""


class TamperDetectedError(AuditUnavailableError):
    """The database no longer extends the history this gateway signed; no checkpoint is
    signed over it any more."""

    def __init__(self, first_bad_seq: int | None, reason: str) -> None:
        super().__init__(f"audit log tampering detected at event {first_bad_seq}: {reason}")
        self.first_bad_seq = first_bad_seq
        self.reason = reason


@dataclass(frozen=True)
class AppendedEvent:
    seq: int
    event_id: str
    event_hash: str
    created_at: datetime
    leaf_hash: bytes = b""  # RFC 9162 leaf hash; the leaf index is seq - 1

    @property
    def leaf_index(self) -> int:
        return self.seq - 1


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


@dataclass(frozen=True)
class WitnessPolicy:
    """The witness whose cosignatures this gateway accepts, and how fresh the newest one must
    be for ``integrity_ok`` (None: any age)."""

    public_key: Ed25519PublicKey
    name: str
    max_age_s: float | None = None


def checked_event(kind: str, actor: str | None) -> tuple[str, str | None]:
    if not _KIND.fullmatch(kind):
        raise ValueError(f"invalid audit event kind {kind!r}")
    if actor is not None and (len(actor) > 200 or _CONTROL.search(actor)):
        raise ValueError("an audit actor is at most 200 characters, without control characters")
    return kind, actor or None


def _frontier(size: int, packed: bytes) -> CompactRange:
    """The head row's compact range; a malformed one is tampering (a 503, never a 500)."""
    packed = bytes(packed)
    try:
        return CompactRange(size, [packed[i : i + 32] for i in range(0, len(packed), 32)])
    except ValueError as exc:
        raise TamperDetectedError(None, f"the head row is malformed: {exc}") from None


def lock_head(connection: sa.Connection, lock_timeout_s: float) -> sa.Row[Any]:
    """Take the append lock (the head row) inside the open transaction; returns the row.

    On PostgreSQL the wait is bounded by ``lock_timeout_s`` set in the locking statement
    itself: ``set_config(..., true)`` is ``SET LOCAL``, and the row filter that calls it runs
    before the row lock is requested, so the bound holds without a round trip of its own."""
    query = sa.select(audit_head).where(audit_head.c.id == 1)
    if connection.dialect.name == "postgresql":
        timeout = sa.func.set_config("lock_timeout", f"{int(lock_timeout_s * 1000)}ms", True)
        query = query.where(timeout.is_not(None)).with_for_update()
    row = execute_first(connection, query).first()
    if row is None:
        raise AuditUnavailableError("audit_head row is missing: run `specgate db upgrade`")
    return row


def insert_events(
    connection: sa.Connection,
    events: Sequence[tuple[str, str | None, dict[str, Any]]],
    mac: EventMac | None = None,
    lock_timeout_s: float = APPEND_LOCK_TIMEOUT_S,
) -> list[AppendedEvent]:
    """Append ``(kind, actor, normalised payload)`` events inside ``connection``'s open
    transaction (from ``gateway.db.write_connection``); they become visible at its commit."""
    return _insert(connection, events, mac, lock_timeout_s)[0]


HeadCheck = Callable[[sa.Connection, sa.Row[Any]], None]


def _insert(
    connection: sa.Connection,
    events: Sequence[tuple[str, str | None, dict[str, Any]]],
    mac: EventMac | None,
    lock_timeout_s: float,
    check_head: HeadCheck | None = None,
) -> tuple[list[AppendedEvent], CompactRange]:
    """``insert_events``, also returning the compact range of the tree after the events;
    ``check_head`` may refuse the locked head row (by raising) before anything is written.
    The first append after migration 0002 adopted a legacy log writes the legacy declaration
    first (and only returns the caller's events)."""
    head = lock_head(connection, lock_timeout_s)
    if check_head is not None:
        check_head(connection, head)
    declare = legacy_declaration_due(connection, head)
    if declare and mac is None:
        # A MAC-less declaration would leave the legacy range unverifiable for good.
        raise AuditUnavailableError(
            f"this log holds {head.legacy_size} legacy events and the first event after them "
            "must carry a MAC: append with the gateway's MAC key (start `specgate serve`)"
        )
    if declare:
        events = [(LEGACY_KIND, "specgate", declaration_payload(head.legacy_size)), *events]
    frontier = _frontier(head.tree_size, head.frontier)
    if not events:
        return [], frontier
    written = build_events(events, head.head_hash, frontier, mac)
    connection.execute(sa.insert(audit_events), written.rows)
    if written.nodes:
        connection.execute(sa.insert(audit_merkle_nodes), written.nodes)
    connection.execute(
        sa.update(audit_head)
        .where(audit_head.c.id == 1)
        .values(
            tree_size=frontier.size,
            head_hash=written.head_hash,
            frontier=b"".join(frontier.hashes),
        )
    )
    appended = written.appended
    return appended[1:] if declare else appended, frontier


@dataclass
class BuiltEvents:
    """Events ready to insert after a head: their rows, the Merkle nodes they complete, what
    each caller is told, and the chain's new head hash."""

    rows: list[dict[str, Any]]
    nodes: list[dict[str, Any]]
    appended: list[AppendedEvent]
    head_hash: str


def build_events(
    events: Sequence[tuple[str, str | None, dict[str, Any]]],
    head_hash: str,
    frontier: CompactRange,
    mac: EventMac | None,
) -> BuiltEvents:
    """Chain ``events`` after the head (``head_hash``, the tree ``frontier``, which is
    extended in place to cover them)."""
    seq, prev_hash = frontier.size, head_hash
    rows: list[dict[str, Any]] = []
    nodes: list[dict[str, Any]] = []
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
        data = event_bytes(**fields, created_at=format_timestamp(created_at))
        digest = hashlib.sha256(data).hexdigest()
        leaf = leaf_hash(data)
        rows.append(
            {
                **fields,
                "created_at": created_at,
                "event_hash": digest,
                "mac": mac.mac(data) if mac else None,
            }
        )
        nodes += [{"level": n[0], "idx": n[1], "hash": h} for n, h in frontier.append(leaf) if n[0]]
        appended.append(AppendedEvent(seq, event_id, digest, created_at, leaf))
        prev_hash = digest
    return BuiltEvents(rows, nodes, appended, prev_hash)


def legacy_declaration_due(connection: sa.Connection, head: sa.Row[Any]) -> bool:
    """Whether nothing was appended since migration 0002 adopted ``legacy_size`` events, and
    no declaration exists yet (a head row widened later must not earn a second one)."""
    if not 0 < head.legacy_size == head.tree_size:
        return False
    declared = sa.select(audit_events.c.seq).where(audit_events.c.kind == LEGACY_KIND).limit(1)
    return connection.execute(declared).first() is None


def content_key_ref(payload: dict[str, Any]) -> str | None:
    """The data key an event's commitments (and stored content) are under, if any."""
    key = payload.get("commitment_key")
    if isinstance(key, dict) and key.get("type") == "data_key":
        ref = key.get("key_ref")
        return ref if isinstance(ref, str) else None
    return None


def record_from_row(row: Any, prefix: str = "") -> EventRecord:
    """The event in ``row``: an ``audit_events`` row, or the columns named ``prefix`` plus
    the column's name in a join."""

    def field(name: str) -> Any:
        return getattr(row, prefix + name)

    return EventRecord(
        seq=field("seq"),
        event_id=field("event_id"),
        created_at=format_timestamp(field("created_at")),
        kind=field("kind"),
        actor=field("actor"),
        payload=field("payload"),
        prev_hash=field("prev_hash"),
        event_hash=field("event_hash"),
        mac=field("mac"),
    )


def read_nodes(connection: sa.Connection, wanted: set[Node]) -> dict[Node, bytes]:
    """The perfect nodes ``wanted``: interior ones stored, leaves (level 0, not stored)
    hashed from their events; one query each. Raises if one is missing."""
    found: dict[Node, bytes] = {}
    interior = sorted(node for node in wanted if node[0])
    if interior:
        key = sa.tuple_(audit_merkle_nodes.c.level, audit_merkle_nodes.c.idx)
        query = sa.select(
            audit_merkle_nodes.c.level, audit_merkle_nodes.c.idx, audit_merkle_nodes.c.hash
        ).where(key.in_(interior))
        for level, index, digest in connection.execute(query):
            found[(level, index)] = bytes(digest)
    leaves = [index + 1 for level, index in wanted if level == 0]
    if leaves:
        by_seq: sa.Select[Any] = sa.select(audit_events).where(audit_events.c.seq.in_(leaves))
        for row in connection.execute(by_seq):
            found[(0, row.seq - 1)] = leaf_hash(record_from_row(row).canonical_bytes())
    missing = wanted - found.keys()
    if missing:
        raise TamperDetectedError(
            None, f"Merkle tree nodes missing from the database: {sorted(missing)[:4]}"
        )
    return found


def _utc(moment: datetime | None) -> datetime | None:
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


class AuditLog:
    def __init__(
        self,
        db: sa.Engine,
        signer: CheckpointSigner | None = None,
        mac: EventMac | None = None,
        state_path: Path | None = None,
        lock_timeout_s: float = APPEND_LOCK_TIMEOUT_S,
        witness: WitnessPolicy | None = None,
    ) -> None:
        """``signer`` may be left out by tools that only append (the key CLI); checkpoints,
        exports and verification need it. Without ``mac`` events are written unauthenticated
        (verification with the MAC key reports them). ``state_path`` keeps the last signed
        checkpoint across restarts; without it, only in memory."""
        self._db = db
        self._signer = signer
        self._mac = mac
        self._state_path = Path(state_path).expanduser() if state_path else None
        self._state = load_state(self._state_path)
        self._anchor_path = beside(self._state_path, ".appended")
        self._alarm_path = beside(self._state_path, ".alarm")
        self._alarm_lock = threading.Lock()
        self._lock_timeout_s = lock_timeout_s
        self._witness = witness
        self._lock = threading.Lock()
        self._checkpoint_lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._writing = False
        # A raised alarm stands across restarts until an operator clears it (``clear_alarm``).
        self.alarm: Alarm | None = load_alarm(self._alarm_path)
        self.tamper: TamperDetectedError | None = (
            None if self.alarm is None else TamperDetectedError(*self._alarm_cause(self.alarm))
        )
        # The tree after this gateway's newest committed append: the database must keep
        # extending it, even before a checkpoint covers it, and across restarts.
        self._appended: Anchor = load_anchor(self._anchor_path)
        # The head after this process's last append, on PostgreSQL (None: not known).
        self._known_head: KnownHead | None = None
        self._sweep: Sweep | None = None  # the scheduled re-verification in progress
        self._sweep_lock = threading.Lock()
        self.reverified_at: float | None = None  # when the last sweep completed (epoch s)

    @property
    def signer(self) -> CheckpointSigner:
        if self._signer is None:
            raise RuntimeError("this AuditLog has no signing key")
        return self._signer

    @property
    def mac(self) -> EventMac | None:
        return self._mac

    @property
    def signed_state(self) -> SignedState:
        return self._state

    @contextmanager
    def observed(self, kind: str) -> Iterator[Callable[[AppendedEvent], None]]:
        """Around each append, whichever way it goes (here or ``gateway.audit.loop_append``):
        where a subclass traces and times it (``ObservedAuditLog``); here nothing. The
        callable is given the appended event."""
        yield lambda _event: None

    def append(self, kind: str, actor: str | None, payload: dict[str, Any]) -> AppendedEvent:
        """Record one event and return once it is committed."""
        with self.observed(kind) as record:
            appended = self.append_unobserved(kind, actor, payload)
            record(appended)
        return appended

    def append_unobserved(
        self, kind: str, actor: str | None, payload: dict[str, Any]
    ) -> AppendedEvent:
        """``append`` inside an observation the caller holds."""
        kind, actor = checked_event(kind, actor)
        pending = _Pending(kind, actor, normalise_payload(payload))
        with self._lock:
            self._queue.append(pending)
            leading = not self._writing
            self._writing = True
        if not leading:
            pending.wake.wait()
        if not pending.done:
            self._lead(pending)
        if isinstance(pending.error, TamperDetectedError):
            self.raise_alarm(pending.error)  # outside the writer's role: it appends itself
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
        kind, actor = checked_event(kind, actor)
        self.forget_known_head()  # this transaction moves the head
        (appended,), _ = _insert(
            connection,
            [(kind, actor, normalise_payload(payload))],
            self._mac,
            self._lock_timeout_s,
            self._check_extends_anchor,
        )
        return appended

    @staticmethod
    def _alarm_cause(alarm: Alarm) -> tuple[int | None, str]:
        return alarm.first_bad_seq, alarm.reason

    def remember_appended(self, frontier: CompactRange, head_hash: str) -> None:
        """Note the tree after this gateway's newest committed events (or the newest head it
        verified), in memory and in the anchor file, before the appends' callers are
        answered (the truncation check)."""
        with self._lock:
            if frontier.size > self._appended.size:
                self._appended = Anchor.after(frontier, head_hash)
                try:
                    save_anchor(self._anchor_path, self._appended)
                except OSError as error:  # kept in memory; a restart checks an older anchor
                    log.error("audit_anchor_not_saved", error=str(error))

    def _check_extends_anchor(self, connection: sa.Connection, head: sa.Row[Any]) -> None:
        """Refuse to append unless the locked head row extends the tree this gateway last
        wrote: no fewer events, and the same root at the anchor's size (from the head's
        compact range when the sizes are equal, from the stored nodes when other writers
        appended since). A history shorter than what this gateway acknowledged is never
        appended on."""
        anchor = self._appended
        if anchor.size == 0:
            return
        if head.tree_size < anchor.size:
            raise TamperDetectedError(
                head.tree_size + 1,
                f"the log has {head.tree_size} events but this gateway wrote {anchor.size}: "
                f"events {head.tree_size + 1}..{anchor.size} were deleted (truncation)",
            )
        if head.tree_size == anchor.size:
            root = _frontier(head.tree_size, head.frontier).root()
        else:
            stored = read_nodes(connection, set(perfect_pieces(0, anchor.size)))
            root = range_hash(0, anchor.size, stored.__getitem__)
        if root != anchor.root:
            raise TamperDetectedError(
                None, f"the first {anchor.size} events are not those this gateway wrote"
            )

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
        """Commit ``batch`` in one transaction (one statement when this process wrote the
        head: ``gateway.audit.known_head``); hand each caller its result or the error."""
        events = [(p.kind, p.actor, p.payload) for p in batch]

        def commit() -> tuple[list[AppendedEvent], CompactRange]:
            with write_connection(self._db) as connection, connection.begin():
                return _insert(
                    connection, events, self._mac, self._lock_timeout_s, self._check_extends_anchor
                )

        try:
            known, self._known_head = self._known_head, None
            written = None if known is None else self._append_at(known, events)
            results, frontier = written or once_more_if_ended(commit)
            self.remember_appended(frontier, results[-1].event_hash)
            if self._db.dialect.name == "postgresql":
                self._known_head = KnownHead.after(frontier, results[-1].event_hash)
        except BaseException as exc:  # every waiting caller must wake, whatever happened
            for pending in batch:
                pending.error = exc
        else:
            for pending, result in zip(batch, results, strict=True):
                pending.result = result
        for pending in batch:
            pending.done = True
            pending.wake.set()

    def claim_known_head(self) -> KnownHead | None:
        """Take the writer's role with the head this process wrote last, when no append of
        this process is in progress and that head is known (PostgreSQL); None otherwise. The
        claimer writes at the head (``gateway.audit.known_head``) and then must call
        ``release_writer``; appends meanwhile queue as behind any writer."""
        if self._db.dialect.name != "postgresql":
            return None
        with self._lock:
            if self._writing or self._queue or self._known_head is None:
                return None
            self._writing = True
            known, self._known_head = self._known_head, None
            return known

    def release_writer(self, head: KnownHead | None, committed: bool = False) -> None:
        """End a ``claim_known_head``: ``head``, the head to write at next (None: unknown, the
        next append takes the lock), which the claimer's events made (``committed``) or which
        is still the one it claimed. The first queued caller becomes the writer."""
        if committed:
            assert head is not None
            self.remember_appended(head.frontier(), head.head_hash)
        with self._lock:
            if head is not None:
                self._known_head = head
            if self._queue:
                self._queue[0].wake.set()
            else:
                self._writing = False

    def forget_known_head(self) -> None:
        """Make the next append take the head row's lock and read the head, as it does after
        another writer's append (``gateway.audit.known_head``)."""
        self._known_head = None

    def _append_at(
        self, known: KnownHead, events: list[tuple[str, str | None, dict[str, Any]]]
    ) -> tuple[list[AppendedEvent], CompactRange] | None:
        """The events written in one statement after the head this process wrote last, or
        None (nothing written) when the head has moved since. A failure is not retried: the
        statement may have committed."""
        frontier = known.frontier()
        built = build_events(events, known.head_hash, frontier, self._mac)
        params = append_params(
            known, frontier, built.head_hash, built.rows, built.nodes, self._lock_timeout_s
        )
        try:
            with read_connection(self._db) as connection:
                moved = append_at(connection, params)
        except sa.exc.DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            # The connection ended under the statement (server restart, failover): whether
            # it committed is read back by the first event's id, on a fresh connection.
            if self.written(built.appended[0].event_id):
                return built.appended, frontier
            return None
        return (built.appended, frontier) if moved else None

    def written(self, event_id: str) -> bool:
        """Whether the event ``event_id`` is in the log (an append whose answer was lost)."""
        query = sa.select(audit_events.c.seq).where(audit_events.c.event_id == event_id)
        with read_connection(self._db) as connection:
            return connection.execute(query).first() is not None

    def ping(self) -> bool:
        """Whether an append could run now: on PostgreSQL the append lock (the head row) is
        taken, within the lock timeout, and let go; a held lock stalls every append, so it
        fails readiness as a stopped server does. SQLite: a read (its write lock would queue
        the probe behind appends)."""

        def probe() -> None:
            if is_sqlite(self._db):
                with self._db.connect() as connection:
                    execute_first(connection, sa.select(audit_head.c.tree_size))
                return
            with write_connection(self._db) as connection, connection.begin() as transaction:
                lock_head(connection, self._lock_timeout_s)
                transaction.rollback()

        try:
            once_more_if_ended(probe)
        except SQLAlchemyError:
            return False
        return True

    def head(self) -> tuple[int, str]:
        """(tree size = seq of the newest event, its event_hash); (0, 64 zeros) when empty."""
        try:
            with self._db.connect() as connection:
                row = connection.execute(sa.select(audit_head)).one()
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
        return row.tree_size, row.head_hash

    # --- checkpoints -----------------------------------------------------------------------

    def checkpoint(self) -> dict[str, Any]:
        """Check that the database extends the last checkpoint this gateway signed, sign one
        over the current tree and record it as a ``checkpoint`` event (the next leaf, so the
        event at seq ``size + 1`` carries the checkpoint of ``size``). Returns the event's
        payload. Raises TamperDetectedError (and raises the alarm) when the check fails."""
        with self._checkpoint_lock:
            if self.tamper is not None:
                raise self.tamper
            try:
                return self._checkpoint()
            except TamperDetectedError as error:
                self.raise_alarm(error)
                raise
            except SQLAlchemyError as exc:
                raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc

    def _checkpoint(self) -> dict[str, Any]:
        signer = self.signer
        self._adopt_legacy()
        # The bulk of the check runs without the append lock; only the tail under it. The
        # anchor is read before the head: this gateway's appends only ever move it forward.
        anchor = self._appended
        with self._db.connect() as connection:
            size = connection.execute(sa.select(audit_head.c.tree_size)).scalar_one()
            state = self._extend(connection, self._state, size, anchor)
        with write_connection(self._db) as connection, connection.begin():
            head = lock_head(connection, self._lock_timeout_s)
            state = self._extend(connection, state, head.tree_size, self._appended)
            if state.frontier.hashes != _frontier(head.tree_size, head.frontier).hashes:
                raise self._located(connection, "the head row's compact range was changed")
            size, root = state.frontier.size, state.frontier.root()
            note = signer.sign_checkpoint(size, root)
            payload = {
                "note": note,
                "size": size,
                "root": b64(root),
                "key_fingerprint": signer.fingerprint,
                "signed_at": format_timestamp(datetime.now(UTC)),
            }
            (event,), after = _insert(
                connection, [("checkpoint", "specgate", payload)], self._mac, self._lock_timeout_s
            )
        self.remember_appended(after, event.event_hash)
        self._state = SignedState(note, state.head_hash, state.frontier)
        try:
            save_state(self._state_path, self._state)
        except OSError as error:  # kept in memory; after a restart an older state is checked
            log.error("checkpoint_state_not_saved", path=str(self._state_path), error=str(error))
        return payload

    def _adopt_legacy(self) -> None:
        """Write the legacy declaration if it is due, so that the checkpoint covers it."""
        with self._db.connect() as connection:
            head = connection.execute(sa.select(audit_head)).one()
        if 0 < head.legacy_size == head.tree_size:
            with write_connection(self._db) as connection, connection.begin():
                insert_events(connection, [], self._mac, self._lock_timeout_s)

    def _extend(
        self, connection: sa.Connection, state: SignedState, size: int, anchor: Anchor
    ) -> SignedState:
        """``state`` extended by the events after it up to ``size``, each checked (sequence,
        chain, hash, MAC); the stored tree must then have the same root, and the tree at the
        ``anchor``'s size (this gateway's newest append, read before ``size``) its root."""
        trusted = state.frontier.size
        appended_size, appended_root = anchor.size, anchor.root
        known = max(trusted, appended_size)
        if size < known:
            raise self._located(
                connection,
                f"the log has {size} events but this gateway signed or wrote {known}: "
                f"events {size + 1}..{known} were deleted (truncation)",
                size + 1,
                before=size,
            )
        frontier, previous_hash = state.frontier.copy(), state.head_hash
        query = (
            sa.select(audit_events)
            .where(audit_events.c.seq > trusted, audit_events.c.seq <= size)
            .order_by(audit_events.c.seq)
        )

        def check_appended() -> None:
            if 0 < appended_size == frontier.size and frontier.root() != appended_root:
                raise self._located(
                    connection,
                    f"events {trusted + 1}..{appended_size} are not those this gateway wrote",
                    trusted + 1,
                    before=trusted,
                )

        macs = LegacyPrefix(self._mac)
        for row in connection.execute(query.execution_options(yield_per=2000)):
            record = record_from_row(row)
            expected = frontier.size + 1
            problem = event_problem(record, expected, previous_hash, macs)
            data = record.canonical_bytes()
            if problem is not None:
                raise self._located(connection, problem[1], problem[0], before=trusted)
            check_appended()
            frontier.append(leaf_hash(data))
            previous_hash = record.event_hash
        check_appended()
        unclosed = macs.finish(frontier.size)
        if unclosed is not None:
            raise self._located(connection, unclosed[1], unclosed[0], before=trusted)
        if frontier.size != size:
            raise self._located(
                connection, f"event {frontier.size + 1} is missing", frontier.size + 1, trusted
            )
        stored = read_nodes(connection, set(perfect_pieces(0, size)))
        if range_hash(0, size, stored.__getitem__) != frontier.root():
            raise self._located(connection, "stored Merkle nodes do not match the events")
        return SignedState(state.note, previous_hash, frontier)

    def _located(
        self,
        connection: sa.Connection,
        reason: str,
        seq: int | None = None,
        before: int | None = None,
    ) -> TamperDetectedError:
        """The alarm for ``reason``, naming the first bad event: an earlier one (before the
        trusted size, found by checking every event's MAC and chain) wins over ``seq``."""
        limit = before if before is not None else self._state.frontier.size
        earlier = self._first_bad_event(connection, limit)
        if earlier is not None and (seq is None or earlier[0] < seq):
            return TamperDetectedError(*earlier)
        return TamperDetectedError(seq, reason)

    def _first_bad_event(self, connection: sa.Connection, upto: int) -> tuple[int, str] | None:
        previous_hash, expected, macs = SignedState.empty().head_hash, 1, LegacyPrefix(self._mac)
        query = (
            sa.select(audit_events).where(audit_events.c.seq <= upto).order_by(audit_events.c.seq)
        )
        for row in connection.execute(query.execution_options(yield_per=2000)):
            record = record_from_row(row)
            problem = event_problem(record, expected, previous_hash, macs)
            if problem is not None:
                return problem[0] if problem[0] is not None else record.seq, problem[1]
            previous_hash, expected = record.event_hash, expected + 1
        if expected <= upto:
            return expected, f"event {expected} is missing"
        return None

    def raise_alarm(self, error: TamperDetectedError) -> None:
        """tamper_detected: error log, the alarm file (it survives restarts), the hook (a
        metric), an audit event (unless the store refuses it: a truncated log is not appended
        on); from now on no checkpoint is signed and ``integrity_ok`` is False, until an
        operator clears it (``clear_alarm``). A second alarm while one stands is logged."""
        with self._alarm_lock:
            if self.tamper is not None:
                log.error("tamper_detected_again", seq=error.first_bad_seq, reason=error.reason)
                return
            self.tamper = error
            self.alarm = Alarm(
                error.first_bad_seq, error.reason, format_timestamp(datetime.now(UTC))
            )
        log.error("tamper_detected", first_bad_seq=error.first_bad_seq, reason=error.reason)
        try:
            save_alarm(self._alarm_path, self.alarm)
        except OSError as failure:  # the alarm stands in memory
            log.error("tamper_alarm_not_saved", error=str(failure))
        self.on_tamper(error)
        event = (
            "tamper_detected",
            "specgate",
            normalise_payload({"first_bad_seq": error.first_bad_seq, "reason": error.reason}),
        )
        try:
            # Recorded where auditors read the log, whatever the head is; not remembered as
            # this gateway's tree, so a head that does not extend it still refuses appends.
            self.forget_known_head()
            with (
                self.observed("tamper_detected"),
                write_connection(self._db) as connection,
                connection.begin(),
            ):
                _insert(connection, [event], self._mac, self._lock_timeout_s)
        except Exception:  # the alarm stands even if the store refuses the event
            log.exception("tamper_event_not_recorded")

    def clear_alarm(
        self, evidence: str, actor: str | None, accept_head: bool = False
    ) -> dict[str, Any]:
        """End the standing alarm with an ``alarm_cleared`` event that names the alarm and the
        operator's ``evidence`` (a ticket, a forensic report); returns its payload. The event
        is appended only where the head still extends what this gateway wrote, so a
        truncation must be repaired first (the events restored) unless ``accept_head``: then
        the database's head becomes what this gateway extends, and the event records the
        range that was lost. Checks run again from the next append and checkpoint."""
        evidence = evidence.strip()
        if not evidence:
            raise ValueError("clearing an alarm needs the evidence it was resolved on")
        with self._checkpoint_lock:
            alarm = self.alarm
            if alarm is None:
                raise ValueError("no tamper alarm stands")
            payload: dict[str, Any] = {
                "alarm": {
                    "first_bad_seq": alarm.first_bad_seq,
                    "reason": alarm.reason,
                    "detected_at": alarm.detected_at,
                },
                "evidence": evidence,
            }
            kind, actor = checked_event("alarm_cleared", actor)
            self.forget_known_head()
            try:
                after = self._record_clearing(kind, actor, payload, accept_head)
            except SQLAlchemyError as exc:
                raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
            with self._lock:
                self._appended = Anchor.after(*after)
                save_anchor(self._anchor_path, self._appended)
            with self._alarm_lock:
                self.tamper, self.alarm = None, None
            save_alarm(self._alarm_path, None)
        log.warning("tamper_alarm_cleared", evidence=evidence, actor=actor)
        return payload

    def _record_clearing(
        self, kind: str, actor: str | None, payload: dict[str, Any], accept_head: bool
    ) -> tuple[CompactRange, str]:
        """Append the ``alarm_cleared`` event (``clear_alarm``); the tree and head hash after
        it."""
        with write_connection(self._db) as connection, connection.begin():
            head = lock_head(connection, self._lock_timeout_s)
            if accept_head:
                payload["accepted_head"] = self._accepted_head(head)
            else:
                self._check_extends_anchor(connection, head)
            (event,), frontier = _insert(
                connection,
                [(kind, actor, normalise_payload(payload))],
                self._mac,
                self._lock_timeout_s,
            )
        return frontier, event.event_hash

    def _accepted_head(self, head: sa.Row[Any]) -> dict[str, Any]:
        """The head an operator accepts, and the tree this gateway had written that it
        replaces (``written``): where the two differ, what was lost is on record."""
        root = _frontier(head.tree_size, head.frontier).root()
        anchor = self._appended
        written = {"size": anchor.size, "root": b64(anchor.root)}
        return {"size": head.tree_size, "root": b64(root), "written": written}

    def watch(self) -> None:
        """Check, without the append lock, that the database still extends the anchor (or the
        signed checkpoint, if newer): the events other writers appended since are checked
        (sequence, chain, hash, MAC) and the head row must hold their tree. Then the anchor
        moves to the head, which this gateway has now verified. Run every
        ``audit_watch_interval_s``, it bounds how long a truncation, a rewrite of the tree or a
        forged event at the head goes unseen on an idle gateway. A failure raises the alarm."""
        if self.tamper is not None:
            return
        anchor = self._appended  # before the head: this gateway's appends only move it on
        base = anchor.as_state() if anchor.size >= self._state.frontier.size else self._state
        try:
            with self._db.connect() as connection:  # one snapshot for the head and events
                head = connection.execute(sa.select(audit_head)).one()
                state = self._extend(connection, base, head.tree_size, anchor)
                if state.frontier.hashes != _frontier(head.tree_size, head.frontier).hashes:
                    raise self._located(connection, "the head row's compact range was changed")
        except TamperDetectedError as error:
            self.raise_alarm(error)
            return
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
        self.remember_appended(state.frontier, state.head_hash)

    def reverify(self, max_events: int) -> bool:
        """One slice of the scheduled re-verification of the signed history
        (``gateway.audit.sweep``): True when it completed a sweep. A problem raises the
        alarm; while an alarm stands, nothing is swept."""
        with self._sweep_lock:
            if self.tamper is not None:
                return False
            sweep = self._sweep
            if sweep is None:
                signed = self._state.frontier
                if signed.size == 0:
                    return False
                sweep = self._sweep = Sweep(signed.size, signed.root(), self._mac)
            try:
                with read_connection(self._db) as connection:
                    problem = sweep.advance(connection, max_events, record_from_row)
            except SQLAlchemyError as exc:
                raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
            if problem is None and not sweep.done:
                return False
            self._sweep = None
        if problem is not None:
            self.raise_alarm(TamperDetectedError(*problem))
            return False
        self.reverified_at = time.time()
        self.on_reverified(sweep)
        return True

    def on_reverified(self, sweep: Sweep) -> None:
        """Hook for subclasses (the metrics); called once per completed sweep."""

    def on_tamper(self, error: TamperDetectedError) -> None:
        """Hook for subclasses (the metrics); called once per alarm."""

    def integrity_ok(self) -> bool:
        """No tampering seen, and (when required) a fresh enough witness cosignature."""
        if self.tamper is not None:
            return False
        witness = self._witness
        if witness is None or witness.max_age_s is None:
            return True
        newest = self.newest_cosignature()
        return newest is not None and time.time() - newest <= witness.max_age_s

    def record_cosignature(self, note: str, actor: str | None) -> int:
        """Record a witness's cosignature of one of this log's checkpoints (a ``cosignature``
        event); returns the cosignature's time. Raises NoteError or ValueError if refused."""
        if self._witness is None:
            raise ValueError("this gateway has no witness key configured")
        checkpoint = verify_checkpoint(note, self.signer.public_key, self.signer.origin)
        cosigned_at = cosignature_time(note, self._witness.name, self._witness.public_key)
        size, _ = self.head()
        if checkpoint.size > size:
            raise ValueError("the checkpoint is larger than this log")
        try:
            with self._db.connect() as connection:
                stored = read_nodes(connection, set(perfect_pieces(0, checkpoint.size)))
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
        if range_hash(0, checkpoint.size, stored.__getitem__) != checkpoint.root:
            raise ValueError("the cosigned checkpoint is not this log's tree at its size")
        self.append(
            "cosignature",
            actor,
            {
                "note": note,
                "size": checkpoint.size,
                "witness": self._witness.name,
                "cosigned_at": cosigned_at,
            },
        )
        return cosigned_at

    def newest_cosignature(self) -> int | None:
        """Time of the newest valid cosignature by the configured witness in the log."""
        if self._witness is None:
            return None
        query = (
            sa.select(audit_events.c.payload)
            .where(audit_events.c.kind == "cosignature")
            .order_by(audit_events.c.seq.desc())
            .limit(20)
        )
        try:
            with self._db.connect() as connection:
                payloads = [row.payload for row in connection.execute(query)]
        except SQLAlchemyError:
            return None
        for payload in payloads:
            note = payload.get("note") if isinstance(payload, dict) else None
            if not isinstance(note, str):
                continue
            try:
                verify_checkpoint(note, self.signer.public_key, self.signer.origin)
                return cosignature_time(note, self._witness.name, self._witness.public_key)
            except NoteError:
                continue
        return None

    def latest_checkpoint(self) -> str:
        """The newest checkpoint note in the log signed by this gateway's key (any replica's);
        signs one when there is none yet."""
        query = (
            sa.select(audit_events.c.payload)
            .where(audit_events.c.kind == "checkpoint")
            .order_by(audit_events.c.seq.desc())
            .limit(20)
        )
        try:
            with self._db.connect() as connection:
                payloads = [row.payload for row in connection.execute(query)]
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
        for payload in payloads:
            note = payload.get("note") if isinstance(payload, dict) else None
            if isinstance(note, str):
                try:
                    verify_checkpoint(note, self.signer.public_key, self.signer.origin)
                except NoteError:
                    continue
                return note
        return str(self.checkpoint()["note"])

    # --- proofs ----------------------------------------------------------------------------

    def _proof(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        try:
            with self._db.connect() as connection:
                stored = read_nodes(connection, nodes_for(ranges))
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
        return [range_hash(start, end, stored.__getitem__) for start, end in ranges]

    def consistency_proof(self, old_size: int, new_size: int) -> list[bytes]:
        """RFC 9162 consistency proof between two tree sizes (new_size at most the current)."""
        return self._proof(consistency_proof_ranges(old_size, new_size))

    def inclusion_proof(self, leaf_index: int, size: int) -> list[bytes]:
        return self._proof(inclusion_proof_ranges(leaf_index, size))

    def event(self, event_id: str) -> EventRecord | None:
        try:
            with self._db.connect() as connection:
                row = connection.execute(
                    sa.select(audit_events).where(audit_events.c.event_id == event_id)
                ).first()
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
        return record_from_row(row) if row else None

    def receipt(self, record: EventRecord) -> dict[str, Any]:
        """The event, the latest checkpoint covering it and the inclusion proof against it:
        what ``specgate audit verify-receipt`` checks offline."""
        note = self.latest_checkpoint()
        if parse_checkpoint(note).size <= record.leaf_index:  # not yet in a checkpoint
            note = str(self.checkpoint()["note"])
        size = parse_checkpoint(note).size
        return {
            "event": {k: v for k, v in record.__dict__.items()},
            "leaf_index": record.leaf_index,
            "leaf_hash": b64(leaf_hash(record.canonical_bytes())),
            "tree_size": size,
            "inclusion_proof": [b64(h) for h in self.inclusion_proof(record.leaf_index, size)],
            "checkpoint": note,
        }

    # --- export and verification -----------------------------------------------------------

    def _seq_range(
        self, since: datetime | None, until: datetime | None
    ) -> tuple[int | None, int | None]:
        """First and last seq of events created in [since, until). Appends take their time
        under the append lock, so the range is one contiguous stretch of the log."""
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

    def _through_declaration(
        self, first_seq: int | None, last_seq: int | None
    ) -> tuple[int | None, int | None]:
        """A range holding only legacy events is extended to the legacy declaration (the next
        append writes it if it is not there yet), which verification needs to accept them."""
        if first_seq is None or last_seq is None:
            return first_seq, last_seq
        try:
            with self._db.connect() as connection:
                legacy = connection.execute(sa.select(audit_head.c.legacy_size)).scalar_one()
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
        return first_seq, legacy + 1 if last_seq <= legacy else last_seq

    def export(
        self,
        since: datetime | None,
        until: datetime | None,
        fmt: ExportFormat = "jsonl",
        actor: str | None = None,
        consistency_from: int | None = None,
    ) -> Iterator[str]:
        """Lines of an export of the events created in [since, until): the events, the tree
        beyond them, and a checkpoint signed (after the usual check) once the ``export``
        event recording this export was written. ``consistency_from`` adds a consistency
        proof from that tree size (an auditor's trusted checkpoint) to the checkpoint's."""
        if fmt not in EXPORT_FORMATS:
            raise ValueError(f"unknown export format {fmt!r}; use one of {EXPORT_FORMATS}")
        since, until = _utc(since), _utc(until)
        first_seq, last_seq = self._through_declaration(*self._seq_range(since, until))
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
        checkpoint = self.checkpoint()
        if consistency_from is not None and not 0 <= consistency_from <= checkpoint["size"]:
            raise ValueError(
                f"consistency_from must be between 0 and the tree size {checkpoint['size']}"
            )
        return self._export_lines(first_seq, last_seq, checkpoint, fmt, consistency_from)

    def _export_lines(
        self,
        first_seq: int | None,
        last_seq: int | None,
        checkpoint: dict[str, Any],
        fmt: ExportFormat,
        consistency_from: int | None = None,
    ) -> Iterator[str]:
        size = int(checkpoint["size"])
        if fmt == "csv":
            yield csv_header()
        start = end = size
        if first_seq is not None and last_seq is not None:
            start, end = first_seq - 1, last_seq
        yield encode_record(self._tree_record(start, end, size, consistency_from), fmt)
        keyed: dict[str, str] = {}  # event id -> the data key its content is under
        if first_seq is not None and last_seq is not None:
            query = (
                sa.select(audit_events)
                .where(audit_events.c.seq.between(first_seq, last_seq))
                .order_by(audit_events.c.seq)
            )
            try:
                with self._db.connect() as connection:
                    for row in connection.execute(query.execution_options(yield_per=1000)):
                        record = record_from_row(row)
                        key_ref = content_key_ref(record.payload)
                        if key_ref is not None:
                            keyed[record.event_id] = key_ref
                        yield encode_record(record, fmt)
            except SQLAlchemyError as exc:
                raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
        if keyed:
            destroyed = self.destroyed_key_refs(size)
            erased = tuple(event_id for event_id, ref in keyed.items() if ref in destroyed)
            if erased:
                yield encode_record(ErasedRecord(erased), fmt)
        yield encode_record(CheckpointRecord(str(checkpoint["note"])), fmt)

    def destroyed_key_refs(self, upto: int) -> set[str]:
        """The data keys that ``erasure`` events among the first ``upto`` say are destroyed."""
        query = sa.select(audit_events.c.payload).where(
            audit_events.c.kind == ERASURE_KIND, audit_events.c.seq <= upto
        )
        try:
            with self._db.connect() as connection:
                payloads = [row.payload for row in connection.execute(query)]
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
        destroyed: set[str] = set()
        for payload in payloads:
            refs = payload.get("key_refs") if isinstance(payload, dict) else None
            if isinstance(refs, list):
                destroyed.update(ref for ref in refs if isinstance(ref, str))
        return destroyed

    def _tree_record(
        self, start: int, end: int, size: int, consistency_from: int | None
    ) -> TreeRecord:
        """What verifying leaves [start, end) against the tree of ``size`` needs besides them."""
        left, right = perfect_pieces(0, start), aligned_pieces(end, size)
        consistency = (
            consistency_proof_ranges(consistency_from, size) if consistency_from is not None else []
        )
        try:
            with self._db.connect() as connection:
                stored = read_nodes(connection, {*left, *right, *nodes_for(consistency)})
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
        return TreeRecord(
            start=start,
            left=tuple(stored[n] for n in left),
            right=tuple(stored[n] for n in right),
            consistency_from=consistency_from,
            consistency=tuple(range_hash(a, b, stored.__getitem__) for a, b in consistency),
        )

    def verify(self, since: datetime | None = None, until: datetime | None = None) -> VerifyReport:
        """The offline check (``verify_export``, with the MAC key) run on the server over the
        events created in [since, until) as the database holds them now, against a checkpoint
        signed after checking that the database extends the previous one. A failure raises
        the tamper alarm."""
        since, until = _utc(since), _utc(until)
        try:
            checkpoint = self.checkpoint()
        except TamperDetectedError as error:
            return VerifyReport(False, 0, error.first_bad_seq, error.reason)
        first_seq, last_seq = self._through_declaration(*self._seq_range(since, until))
        if last_seq is not None and last_seq > checkpoint["size"]:  # written after signing
            last_seq = checkpoint["size"]
        if first_seq is None or last_seq is None or first_seq > last_seq:
            first_seq = last_seq = None
        lines = self._export_lines(first_seq, last_seq, checkpoint, "jsonl")
        report = verify_export(lines, self.signer.public_key_pem(), mac=self._mac)
        if not report.ok:
            with self._checkpoint_lock:
                self.raise_alarm(TamperDetectedError(report.first_bad_seq, report.reason))
        return report
