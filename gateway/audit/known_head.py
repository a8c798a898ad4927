"""Appending at the head this process wrote last: one statement, one round trip (PostgreSQL).

An append in a transaction is six round trips: BEGIN, the head row locked, the event, the
Merkle nodes it completes, the new head, COMMIT. Each is a wake-up of the database backend and
of the writing thread, which on a busy machine costs far more than the loopback. When the
newest events are this process's own, it knows the head (size, hash, compact range) and can
write the events, their nodes and the new head in one statement, in autocommit (so the
statement is its own transaction, durable when it returns), conditioned on the head row being
exactly what it knows: the ``UPDATE`` of the head takes the row's lock (bounded by the lock
timeout its own row filter sets, as ``lock_head`` does) and the inserts read from its result,
so nothing is written unless the head was unchanged. If another writer moved it (another
replica, the CLI, an append inside another transaction) nothing is written and the caller
appends the usual way, under the lock.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from gateway.audit.merkle import CompactRange

# The events, the nodes and the new head, only if the head is the one known (``moved``).
# Every parameter goes in binary (``%(name)b``): in text format psycopg writes each array
# element through Python regular expressions, quoting and escaping it, and a payload's JSON
# text has a backslash-escaped quote every few characters, so text conversion was the largest
# piece of the loop's own work per append (bench/results/2026-12-06-request-path.md).
APPEND = """
WITH moved AS (
    UPDATE audit_head
    SET tree_size = %(new_size)b, head_hash = %(new_hash)b, frontier = %(new_frontier)b
    WHERE id = 1 AND tree_size = %(size)b AND head_hash = %(hash)b AND frontier = %(frontier)b
        AND set_config('lock_timeout', %(lock_timeout)b, true) IS NOT NULL
    RETURNING id
), events AS (
    INSERT INTO audit_events
        (seq, event_id, created_at, kind, actor, payload, prev_hash, event_hash, mac)
    SELECT e.* FROM moved, unnest(
        %(seq)b::bigint[], %(event_id)b::varchar[], %(created_at)b::timestamptz[],
        %(kind)b::varchar[], %(actor)b::varchar[], %(payload)b::text[]::json[],
        %(prev_hash)b::varchar[], %(event_hash)b::varchar[], %(mac)b::varchar[]
    ) AS e
), nodes AS (
    INSERT INTO audit_merkle_nodes (level, idx, hash)
    SELECT n.* FROM moved, unnest(%(level)b::smallint[], %(idx)b::bigint[], %(node)b::bytea[])
        AS n
)
SELECT count(*) FROM moved
"""

_EVENT_COLUMNS = ("seq", "event_id", "created_at", "kind", "actor", "prev_hash", "event_hash")


@dataclass(frozen=True)
class KnownHead:
    """The head after this process's last committed append."""

    size: int
    head_hash: str
    hashes: tuple[bytes, ...]

    def frontier(self) -> CompactRange:
        """A fresh copy of the compact range (appending extends it in place)."""
        return CompactRange(self.size, list(self.hashes))

    @classmethod
    def after(cls, frontier: CompactRange, head_hash: str) -> KnownHead:
        return cls(frontier.size, head_hash, tuple(frontier.hashes))


def append_params(
    known: KnownHead,
    frontier: CompactRange,
    head_hash: str,
    rows: Sequence[dict[str, Any]],
    nodes: Sequence[dict[str, Any]],
    lock_timeout_s: float,
) -> dict[str, Any]:
    """The parameters of ``APPEND`` for ``rows`` and ``nodes`` (built after ``known``) and the
    new head (``frontier``, ``head_hash``)."""
    return {
        "new_size": frontier.size,
        "new_hash": head_hash,
        "new_frontier": b"".join(frontier.hashes),
        "size": known.size,
        "hash": known.head_hash,
        "frontier": b"".join(known.hashes),
        "lock_timeout": f"{int(lock_timeout_s * 1000)}ms",
        **{column: [row[column] for row in rows] for column in _EVENT_COLUMNS},
        "payload": [json.dumps(row["payload"]) for row in rows],
        "mac": [row["mac"] for row in rows],
        "level": [node["level"] for node in nodes],
        "idx": [node["idx"] for node in nodes],
        "node": [node["hash"] for node in nodes],
    }


def append_at(connection: sa.Connection, params: dict[str, Any]) -> bool:
    """Run ``APPEND`` with ``params`` (``append_params``) in one autocommitted statement on
    ``connection``; False, with nothing written, when the head row is not the known one."""
    moved = connection.exec_driver_sql(APPEND, params).scalar_one()
    return bool(moved)
