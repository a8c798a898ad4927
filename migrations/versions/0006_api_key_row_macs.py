"""API key rows carry a MAC and a version (``gateway.key_rows``).

- ``api_keys.version``: how many times the gateway wrote the row (1 at creation, +1 at each
  change); the row's newest `key` audit event records it. Existing rows start at 0.
- ``api_keys.row_mac``: the row's MAC under a sub-key of the audit MAC key. This migration
  does not hold that key, so existing rows are left NULL: the first gateway that starts with
  the key seals them (``KeyStore.seal_unsealed``, a `key` event each), and from then on a row
  without a valid MAC is refused.
- A partial index on the `key` events by the key id in their payload, so that finding a key's
  newest event (every lookup of a key that is not cached) reads one index entry however long
  the log is.
- The writer role may update ``version`` and ``row_mac`` (with ``revoked_at`` and
  ``store_content``, which it may already change).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

KEY_EVENTS_INDEX = "ix_audit_events_key_id"
# The expressions ``gateway.key_rows.event_key_id`` queries with, so that the index applies.
_KEY_ID = {
    "postgresql": "(payload ->> 'key_id')",
    "sqlite": "json_extract(payload, '$.key_id')",
}


def _writer_role() -> str:
    previous = importlib.import_module("migrations.versions.0002_merkle_tree_mac_roles")
    role: str = previous.writer_role()
    return role


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("version", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("row_mac", sa.String(64), nullable=True))
    dialect = op.get_bind().dialect.name
    op.execute(
        f"CREATE INDEX {KEY_EVENTS_INDEX} ON audit_events ({_KEY_ID[dialect]}, seq) "
        "WHERE kind = 'key'"
    )
    if dialect == "postgresql":
        op.execute(f"GRANT UPDATE (version, row_mac) ON api_keys TO {_writer_role()}")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"REVOKE UPDATE (version, row_mac) ON api_keys FROM {_writer_role()}")
    op.drop_index(KEY_EVENTS_INDEX, table_name="audit_events")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("row_mac")
        batch.drop_column("version")
