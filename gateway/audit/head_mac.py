"""Whether a MAC key is this log's own, checked on its newest event before appending with it.

A tool that appends with another deployment's MAC key (``specgate keys create`` pointed at
the wrong key file) writes events that every later check reports as forged, from the first
of them on. The newest event's MAC tells it in one read, before anything is written.
"""

from __future__ import annotations

import sqlalchemy as sa

from gateway.audit.log import record_from_row
from gateway.audit.mac import EventMac
from gateway.audit.schema import audit_events, audit_head


def head_mac_problem(connection: sa.Connection, mac: EventMac) -> str | None:
    """Why ``mac`` is not the key of the log in this database, or None: the newest event
    verifies with it, the log is empty, or it holds only events adopted from before MACs."""
    newest = connection.execute(
        sa.select(audit_events).order_by(audit_events.c.seq.desc()).limit(1)
    ).first()
    if newest is None:
        return None
    if newest.mac is None:
        legacy_size = connection.execute(sa.select(audit_head.c.legacy_size)).scalar()
        if newest.seq <= (legacy_size or 0):
            return None
    if mac.valid(record_from_row(newest).canonical_bytes(), newest.mac):
        return None
    return (
        f"the MAC key {mac.key_id} does not verify the newest audit event (seq {newest.seq}), "
        "so it is not this deployment's key"
    )
