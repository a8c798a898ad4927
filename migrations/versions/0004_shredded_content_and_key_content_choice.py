"""Ciphertext goes with its data key; a key's content storage choice can be changed.

- ``privacy_content.key_ref`` references ``privacy_data_keys`` with ``ON DELETE CASCADE``:
  destroying a data key (erasure, retention) deletes the ciphertext under it in the same
  transaction, and no row can be stored under a key that is gone. Rows left by erasures
  before this revision (their keys already destroyed and recorded by those `erasure` events)
  are deleted first; they could not be decrypted by anyone.
- The writer role may change ``api_keys.store_content`` (the admin API's key update, audited
  as a `key` event in the same transaction), as it may already set ``revoked_at``.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_FOREIGN_KEY = "privacy_content_key_ref_fkey"


def _writer_role() -> str:
    previous = importlib.import_module("migrations.versions.0002_merkle_tree_mac_roles")
    role: str = previous.writer_role()
    return role


def upgrade() -> None:
    op.execute(
        "DELETE FROM privacy_content WHERE key_ref NOT IN (SELECT key_ref FROM privacy_data_keys)"
    )
    with op.batch_alter_table("privacy_content") as batch:
        batch.create_foreign_key(
            _FOREIGN_KEY, "privacy_data_keys", ["key_ref"], ["key_ref"], ondelete="CASCADE"
        )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"GRANT UPDATE (store_content) ON api_keys TO {_writer_role()}")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"REVOKE UPDATE (store_content) ON api_keys FROM {_writer_role()}")
    with op.batch_alter_table("privacy_content") as batch:
        batch.drop_constraint(_FOREIGN_KEY, type_="foreignkey")
