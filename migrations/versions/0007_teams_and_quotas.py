"""Teams and quotas (``gateway.teams``, ``gateway.quota_windows``, ``gateway.quotas``).

- ``teams``: one row per team (its name and when it was made); what it may use is its newest
  `quota` audit event, not a column.
- ``api_keys.team_id``: the team a key belongs to (NULL: none). The row MAC covers it when it
  is set (``gateway.key_rows``), so rows written before stay valid.
- ``quota_windows``: request and token counts per key or team and window (minute, day,
  month), one row each, reset in place when its window passes.
- A partial index on the `quota` events by their subject, so that finding a key's or team's
  newest quota reads one index entry however long the log is.
- The writer role may read and insert teams, set ``api_keys.team_id``, and read and write
  the windows.

Revision ID: 0007
Revises: 0006
Create Date: 2027-01-15
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

QUOTA_EVENTS_INDEX = "ix_audit_events_quota_subject"
# The expressions ``gateway.quotas`` queries with, so that the index applies.
_SUBJECT = {
    "postgresql": "(payload ->> 'subject')",
    "sqlite": "json_extract(payload, '$.subject')",
}


def _writer_role() -> str:
    previous = importlib.import_module("migrations.versions.0002_merkle_tree_mac_roles")
    role: str = previous.writer_role()
    return role


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("team_id", sa.String(100), primary_key=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "quota_windows",
        sa.Column("subject", sa.String(120), primary_key=True),
        sa.Column("window", sa.String(8), primary_key=True),
        sa.Column("starts_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("requests", sa.BigInteger, nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
    )
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("team_id", sa.String(100), nullable=True))
    dialect = op.get_bind().dialect.name
    op.execute(
        f"CREATE INDEX {QUOTA_EVENTS_INDEX} ON audit_events ({_SUBJECT[dialect]}, seq) "
        "WHERE kind = 'quota'"
    )
    if dialect != "postgresql":
        return
    role = _writer_role()
    for table in ("teams", "quota_windows"):
        op.execute(f"REVOKE ALL ON {table} FROM PUBLIC")
    op.execute(f"GRANT SELECT, INSERT ON teams TO {role}")
    op.execute(f"GRANT SELECT, INSERT, UPDATE ON quota_windows TO {role}")
    op.execute(f"GRANT UPDATE (team_id) ON api_keys TO {role}")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"REVOKE UPDATE (team_id) ON api_keys FROM {_writer_role()}")
    op.drop_index(QUOTA_EVENTS_INDEX, table_name="audit_events")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("team_id")
    op.drop_table("quota_windows")
    op.drop_table("teams")
