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
    # HMAC-SHA256 (hex) of the event's canonical bytes by the writing gateway; NULL when the
    # writer had no MAC key (verification with the key reports such rows).
    sa.Column("mac", sa.String(64), nullable=True),
)

# The Merkle tree's perfect subtrees: node (level, idx) is the hash of leaves
# [idx * 2**level, (idx + 1) * 2**level), for level >= 1 (a leaf's hash is computed from its
# event, seq = idx + 1). Written once, when the subtree's last leaf is appended, so any proof
# reads O(log n) rows.
audit_merkle_nodes = sa.Table(
    "audit_merkle_nodes",
    metadata,
    sa.Column("level", sa.SmallInteger, primary_key=True, autoincrement=False),
    sa.Column("idx", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("hash", sa.LargeBinary(32), nullable=False),
)

# One row (id = 1): the tree size, the chain's head hash and the compact range (the frontier's
# hashes, concatenated, largest subtree first). Appends lock this row (SELECT ... FOR UPDATE),
# which needs UPDATE on it: only the writer role can take the append lock. ``legacy_size``:
# the events migration 0002 adopted from revision 0001 (see ``legacy``); the writer role cannot
# change it, and verification trusts only the MAC'd declaration it causes to be written.
audit_head = sa.Table(
    "audit_head",
    metadata,
    sa.Column("id", sa.SmallInteger, primary_key=True, autoincrement=False),
    sa.Column("tree_size", sa.BigInteger, nullable=False),
    sa.Column("head_hash", sa.String(64), nullable=False),
    sa.Column("frontier", sa.LargeBinary, nullable=False),
    sa.Column("legacy_size", sa.BigInteger, nullable=False, server_default="0"),
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
    # Whether this key's requests keep their text (migration 0003); NULL: the server setting.
    sa.Column("store_content", sa.Boolean, nullable=True),
    # Migration 0006 (``gateway.key_rows``): the row's change count, which its newest `key`
    # event records, and its MAC under a sub-key of the audit MAC key (NULL: not sealed yet).
    sa.Column("version", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("row_mac", sa.String(64), nullable=True),
    # Migration 0007 (``gateway.teams``): the team the key belongs to, if any; sealed by the
    # row MAC when set, so that a key cannot be moved to another team's quota unseen.
    sa.Column("team_id", sa.String(100), nullable=True),
)

# Migration 0007 (``gateway.teams``): the teams keys may belong to. What a team may use is
# its newest `quota` audit event (``gateway.quotas``), not a column.
teams = sa.Table(
    "teams",
    metadata,
    sa.Column("team_id", sa.String(100), primary_key=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)
