"""Instance leases: one row per running gateway, renewed on a heartbeat, so that any live
instance can mark the unanswered requests of one that stopped renewing (a crashed replica
that never comes back) as `interrupted`.

The writer role may insert, renew, read and delete leases (``gateway.leases``); events stay
append-only as before.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def _writer_role() -> str:
    previous = importlib.import_module("migrations.versions.0002_merkle_tree_mac_roles")
    role: str = previous.writer_role()
    return role


def upgrade() -> None:
    op.create_table(
        "instance_leases",
        sa.Column("instance_id", sa.String(100), primary_key=True),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False, index=True),
    )
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("REVOKE ALL ON instance_leases FROM PUBLIC")
    op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON instance_leases TO {_writer_role()}")


def downgrade() -> None:
    op.drop_table("instance_leases")
