"""Privacy tables: per-subject data keys, encrypted content outside the chain, legal holds;
and a per-key content storage choice (``api_keys.store_content``, NULL: the server's setting).

The writer role may insert and read content (never change it), insert, read and delete data
keys (erasure and retention destroy them), and place and release holds. Events stay
append-only as before; nothing here touches them.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_TABLES = ("privacy_data_keys", "privacy_content", "privacy_holds")


def _writer_role() -> str:
    previous = importlib.import_module("migrations.versions.0002_merkle_tree_mac_roles")
    role: str = previous.writer_role()
    return role


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("store_content", sa.Boolean, nullable=True))
    op.create_table(
        "privacy_data_keys",
        sa.Column("key_ref", sa.String(32), primary_key=True),
        sa.Column("subject_ref", sa.String(32), nullable=False, index=True),
        sa.Column("day", sa.String(10), nullable=False),
        sa.Column("wrapped_key", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, index=True),
        sa.UniqueConstraint("subject_ref", "day", name="privacy_data_keys_subject_day"),
    )
    op.create_table(
        "privacy_content",
        sa.Column("content_id", sa.String(36), primary_key=True),
        sa.Column("key_ref", sa.String(32), nullable=False, index=True),
        sa.Column("part", sa.String(16), nullable=False),
        sa.Column("ciphertext", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "privacy_holds",
        sa.Column("subject_ref", sa.String(32), primary_key=True),
        sa.Column("placed_at", sa.DateTime(timezone=True), nullable=False),
    )
    if op.get_bind().dialect.name != "postgresql":
        return
    role = _writer_role()
    for table in _TABLES:
        op.execute(f"REVOKE ALL ON {table} FROM PUBLIC")
    op.execute(f"GRANT SELECT, INSERT ON privacy_content TO {role}")
    op.execute(f"GRANT SELECT, INSERT, DELETE ON privacy_data_keys TO {role}")
    op.execute(f"GRANT SELECT, INSERT, DELETE ON privacy_holds TO {role}")


def downgrade() -> None:
    for table in reversed(_TABLES):
        op.drop_table(table)
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("store_content")
