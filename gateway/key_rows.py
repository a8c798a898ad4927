"""What makes an ``api_keys`` row trustworthy when whoever controls the database is not.

The database's owner or superuser can write any row but holds none of the gateway's keys. A
key row is accepted only when two checks pass, on every lookup that reaches the database
(``KeyStore.authenticate``; the key cache only remembers what passed them):

1. **The row's MAC.** ``row_mac`` is HMAC-SHA256 over the row's security-relevant columns (key
   id, secret hash, name, role, creation and revocation times, content choice, version, and
   the team where there is one: a key moved to a team with a larger quota fails it) as
   canonical JSON, under a sub-key of the audit MAC key, HMAC(key, ``specgate api_keys v1``):
   a row MAC never verifies as an event MAC, nor the reverse. A promoted role, a swapped
   secret hash, or a row inserted with a secret of the attacker's choice (even with another
   row's MAC and version copied in: the key id is covered) fails it.
2. **The row is the newest state the gateway wrote.** A MAC over the row alone would let the
   attacker put back an older row the gateway once wrote: the row from before a revocation
   un-revokes the key. So every write of a row increments its ``version``, and the `key`
   audit event written in the same transaction records that version. The audit chain is the
   source of truth: the key's newest `key` event must carry the gateway's event MAC (an
   edited event fails it), record the row's version and not be a revocation. An older row
   has an older version than the newest event.

A row that fails either is refused as an unknown key is (401), and raises the tamper alarm
once per key id in each process (``AuditLog.raise_alarm``).

What remains to the attacker is to remove the key's newest events from the log as well. That
rewrites signed history, which the log's own check catches: the next checkpoint, within the
checkpoint interval of the change.

Rows from before migration 0006 have no MAC. The first gateway that starts with the MAC key
seals them (``KeyStore.seal_unsealed``): an active row whose name, role and revocation state
agree with its newest `key` event gets version 1, its MAC and a `sealed` key event; one that
disagrees stays unsealed and raises the alarm. After that a row without a valid MAC is
refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from gateway.audit.canonical import canonical_json, format_timestamp
from gateway.audit.log import record_from_row
from gateway.audit.mac import EventMac
from gateway.audit.records import EventRecord
from gateway.audit.schema import api_keys, audit_events

ROW_MAC_LABEL = b"specgate api_keys v1"
SEALED_COLUMNS = (
    "key_id",
    "key_hash",
    "name",
    "role",
    "created_at",
    "revoked_at",
    "store_content",
    "version",
)
KEY_EVENT = "key"
REVOKED = "revoked"
# The key id in a `key` event's payload, written as migration 0006's index is, so that the
# index serves the lookup.
_EVENT_KEY_ID = {
    "postgresql": "(audit_events.payload ->> 'key_id')",
    "sqlite": "json_extract(audit_events.payload, '$.key_id')",
}


def row_bytes(row: Mapping[Any, Any]) -> bytes:
    """The canonical bytes a key row's MAC is computed over."""
    fields = {name: row[name] for name in SEALED_COLUMNS}
    if row.get("team_id") is not None:
        # Only when set, so that the rows sealed before teams (migration 0007) keep their MAC.
        fields["team_id"] = row["team_id"]
    for moment in ("created_at", "revoked_at"):
        if fields[moment] is not None:
            fields[moment] = format_timestamp(fields[moment])
    return canonical_json(fields).encode("utf-8")


def _newest_key_event_seq(dialect: str, key_id: sa.ColumnElement[str]) -> Any:
    """The seq of the newest `key` event about ``key_id`` (a literal kind: the index is
    partial on it)."""
    return (
        sa.select(sa.func.max(audit_events.c.seq))
        .where(
            sa.literal_column("audit_events.kind") == sa.literal_column(f"'{KEY_EVENT}'"),
            sa.literal_column(_EVENT_KEY_ID[dialect]) == key_id,
        )
        .scalar_subquery()
    )


_NEWEST = audit_events.alias("newest_key_event")


def keys_with_newest_event(dialect: str) -> sa.Select[Any]:
    """``api_keys`` rows, each with its newest `key` event's columns (``event_`` and the
    column's name; NULL when there is none): one statement, so one snapshot, in which a
    row and its event are always each other's (a revocation committing between two reads
    would otherwise look like an older row put back)."""
    newest = _newest_key_event_seq(dialect, api_keys.c.key_id)
    return sa.select(api_keys, *(c.label(f"event_{c.name}") for c in _NEWEST.c)).select_from(
        api_keys.outerjoin(_NEWEST, _NEWEST.c.seq == newest)
    )


def newest_event(row: sa.Row[Any]) -> EventRecord | None:
    """The event half of a ``keys_with_newest_event`` row."""
    if row.event_seq is None:
        return None
    return record_from_row(row, prefix="event_")


class RowSeal:
    """Seals key rows and checks them against their newest `key` event."""

    def __init__(self, mac: EventMac) -> None:
        self._events = mac
        self._rows = mac.derived(ROW_MAC_LABEL)

    def seal(self, row: Mapping[Any, Any]) -> str:
        return self._rows.mac(row_bytes(row))

    def problem(self, row: Mapping[Any, Any], newest: EventRecord | None) -> str | None:
        """Why the active ``row`` is not to be trusted, or None."""
        key = f"api key {row['key_id']}"
        if not self._rows.valid(row_bytes(row), row["row_mac"]):
            return f"{key}: its row does not carry the gateway's MAC (written outside it)"
        if newest is None:
            return f"{key}: no `key` event in the audit log records its row"
        if not self._events.valid(newest.canonical_bytes(), newest.mac):
            return f"{key}: its newest `key` event (seq {newest.seq}) fails its MAC"
        action, version = newest.payload.get("action"), newest.payload.get("version")
        if action == REVOKED or version != row["version"]:
            return (
                f"{key}: its row (version {row['version']}) is not the state its newest `key` "
                f"event (seq {newest.seq}: {action}, version {version}) records; an older "
                "row was put back"
            )
        return None


def unsealed_row_problem(row: Mapping[Any, Any], newest: EventRecord | None) -> str | None:
    """Why an active row without a MAC may not be sealed, or None. Only a row from before
    migration 0006 may (its newest `key` event has no version: one written since would), and
    its name, role and active state must be what that event says."""
    key = f"api key {row['key_id']}"
    if newest is None:
        return f"{key}: unsealed row, and no `key` event in the audit log records it"
    payload = newest.payload
    if "version" in payload:
        return f"{key}: unsealed row of a key whose `key` events are versioned (MAC removed)"
    recorded = (payload.get("name"), payload.get("role"), payload.get("action") == REVOKED)
    if recorded != (row["name"], row["role"], False):
        return (
            f"{key}: unsealed row (name {row['name']!r}, role {row['role']}, active) differs "
            f"from its newest `key` event (seq {newest.seq}: name {recorded[0]!r}, role "
            f"{recorded[1]}, {payload.get('action')})"
        )
    return None
