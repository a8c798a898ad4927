"""Table definitions shared by the audit log, the key store and the migrations."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

# One append-only table: rows are only ever inserted (PostgreSQL triggers refuse the rest).
audit_events = sa.Table(
    "audit_events",
    metadata,
    sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("event_id", sa.String(36), nullable=False, unique=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, index=True),
    sa.Column("kind", sa.String(32), nullable=False, index=True),
    sa.Column("actor", sa.String(200), nullable=True),
    # Plain ``json`` on PostgreSQL, not ``jsonb``: it keeps numbers exactly as written.
    sa.Column("payload", sa.JSON, nullable=False),
    sa.Column("prev_hash", sa.String(64), nullable=False),
    sa.Column("event_hash", sa.String(64), nullable=False, unique=True),
)

api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("key_id", sa.String(32), primary_key=True),
    sa.Column("name", sa.String(100), nullable=False),
    sa.Column("role", sa.String(16), nullable=False),
    sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
)
