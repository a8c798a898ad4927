"""Audit events (append-only, hash-chained) and API keys.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_PG_REFUSE_FUNCTION = """
CREATE FUNCTION audit_events_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_events is append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END
$$
"""
_PG_TRIGGERS = (
    "CREATE TRIGGER audit_events_no_update_delete BEFORE UPDATE OR DELETE ON audit_events "
    "FOR EACH ROW EXECUTE FUNCTION audit_events_refuse_change()",
    "CREATE TRIGGER audit_events_no_truncate BEFORE TRUNCATE ON audit_events "
    "FOR EACH STATEMENT EXECUTE FUNCTION audit_events_refuse_change()",
)
_SQLITE_TRIGGERS = tuple(
    f"CREATE TRIGGER audit_events_no_{op_name.lower()} BEFORE {op_name} ON audit_events "
    f"BEGIN SELECT RAISE(ABORT, 'audit_events is append-only: {op_name} refused'); END"
    for op_name in ("UPDATE", "DELETE")
)


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("event_id", sa.String(36), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("actor", sa.String(200), nullable=True),
        sa.Column("payload", sa.JSON, nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("event_hash", sa.String(64), nullable=False, unique=True),
    )
    op.create_index("ix_audit_events_created_at", "audit_events", ["created_at"])
    op.create_index("ix_audit_events_kind", "audit_events", ["kind"])
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    # A name identifies at most one active key; a revoked key's name may be reused.
    op.create_index(
        "ux_api_keys_active_name",
        "api_keys",
        ["name"],
        unique=True,
        postgresql_where=sa.text("revoked_at IS NULL"),
        sqlite_where=sa.text("revoked_at IS NULL"),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_REFUSE_FUNCTION)
        for statement in _PG_TRIGGERS:
            op.execute(statement)
    else:
        for statement in _SQLITE_TRIGGERS:
            op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER audit_events_no_truncate ON audit_events")
        op.execute("DROP TRIGGER audit_events_no_update_delete ON audit_events")
        op.execute("DROP FUNCTION audit_events_refuse_change()")
    op.drop_table("api_keys")
    op.drop_table("audit_events")
