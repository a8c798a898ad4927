"""Merkle tree nodes, the append-lock head row, per-event MACs and the writer role.

The owner (the role running this migration) keeps ownership of every table. The writer role
(``specgate_writer`` unless ``SPECGATE_DB_WRITER_ROLE`` names another) gets INSERT and SELECT
on the append-only tables and UPDATE on the head row only, so it can neither change history
nor disable the triggers (only an owner or superuser can). The gateway logs in as a member of
the writer role (see docs/deploy.md). The role is created NOLOGIN if it does not exist.

An existing log (from revision 0001) is adopted: its events, read in seq order a page at a
time (bounded memory), are checked (gapless seqs, every chain hash) and become leaves 1..N of
the tree, with the interior nodes and the head row's compact range exactly as appending them
would have left them. Their MAC stays empty and the head row records ``legacy_size = N``; the
first event appended afterwards is the MAC'd declaration of N that verification relies on
(see ``gateway.audit.legacy``). A chain that no longer verifies is refused, naming the event.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import os
import re

import sqlalchemy as sa
from alembic import op

from gateway.audit.canonical import format_timestamp
from gateway.audit.merkle import CompactRange, leaf_hash
from gateway.audit.records import EventRecord
from gateway.audit.verify import event_problem

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

DEFAULT_WRITER_ROLE = "specgate_writer"
GENESIS_HASH = "0" * 64
_APPEND_ONLY = ("audit_events", "audit_merkle_nodes")
ADOPT_PAGE = 2000  # events read per query while adopting a revision-0001 log
_EVENT_FIELDS = ("seq", "event_id", "kind", "actor", "prev_hash", "event_hash")
_legacy_events = sa.table(
    "audit_events",
    *(sa.column(name) for name in _EVENT_FIELDS),
    sa.column("created_at", sa.DateTime(timezone=True)),
    sa.column("payload", sa.JSON),
)
_nodes = sa.table(
    "audit_merkle_nodes", sa.column("level"), sa.column("idx"), sa.column("hash", sa.LargeBinary)
)


def writer_role() -> str:
    role = os.environ.get("SPECGATE_DB_WRITER_ROLE", DEFAULT_WRITER_ROLE)
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", role):
        raise ValueError(f"SPECGATE_DB_WRITER_ROLE {role!r} is not a plain lower-case name")
    return role


_CREATE_ROLE = """
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
        CREATE ROLE {role} NOLOGIN;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL;  -- created concurrently by another database's migration
END
$$
"""


def upgrade() -> None:
    bind = op.get_bind()
    op.add_column("audit_events", sa.Column("mac", sa.String(64), nullable=True))
    op.create_table(
        "audit_merkle_nodes",
        sa.Column("level", sa.SmallInteger, primary_key=True, autoincrement=False),
        sa.Column("idx", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("hash", sa.LargeBinary(32), nullable=False),
    )
    op.create_table(
        "audit_head",
        sa.Column("id", sa.SmallInteger, primary_key=True, autoincrement=False),
        sa.Column("tree_size", sa.BigInteger, nullable=False),
        sa.Column("head_hash", sa.String(64), nullable=False),
        sa.Column("frontier", sa.LargeBinary, nullable=False),
        sa.Column("legacy_size", sa.BigInteger, nullable=False, server_default="0"),
        sa.CheckConstraint("id = 1", name="audit_head_single_row"),
    )
    size, head_hash, frontier = _adopt_legacy_events(bind)
    op.execute(
        sa.text(
            "INSERT INTO audit_head (id, tree_size, head_hash, frontier, legacy_size) "
            "VALUES (1, :n, :h, :f, :n)"
        ).bindparams(n=size, h=head_hash, f=frontier)
    )
    if bind.dialect.name == "postgresql":
        _postgres_triggers_and_roles()
    else:
        for op_name in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER audit_merkle_nodes_no_{op_name.lower()} BEFORE {op_name} ON "
                f"audit_merkle_nodes BEGIN SELECT RAISE(ABORT, "
                f"'audit_merkle_nodes is append-only: {op_name} refused'); END"
            )


def _adopt_legacy_events(bind: sa.Connection) -> tuple[int, str, bytes]:
    """Build the tree over the existing events; returns (N, last event_hash, compact range)."""
    frontier, previous_hash = CompactRange(), GENESIS_HASH
    seq = _legacy_events.c.seq
    while True:
        page = bind.execute(
            sa.select(_legacy_events).where(seq > frontier.size).order_by(seq).limit(ADOPT_PAGE)
        ).all()
        if not page:
            return frontier.size, previous_hash, b"".join(frontier.hashes)
        nodes: list[dict[str, object]] = []
        for row in page:
            record = EventRecord(
                **{name: getattr(row, name) for name in _EVENT_FIELDS},
                created_at=format_timestamp(row.created_at),
                payload=row.payload,
            )
            problem = event_problem(record, frontier.size + 1, previous_hash, None)
            if problem is not None:
                raise RuntimeError(
                    f"cannot adopt the existing audit log: {problem[1]}; it was changed after "
                    "it was written (restore audit_events from a backup, or ask for support)"
                )
            completed = frontier.append(leaf_hash(record.canonical_bytes()))
            nodes += [{"level": n[0], "idx": n[1], "hash": h} for n, h in completed if n[0]]
            previous_hash = record.event_hash
        if nodes:
            bind.execute(sa.insert(_nodes), nodes)


def _postgres_triggers_and_roles() -> None:
    op.execute(
        "CREATE TRIGGER audit_merkle_nodes_no_update_delete BEFORE UPDATE OR DELETE ON "
        "audit_merkle_nodes FOR EACH ROW EXECUTE FUNCTION audit_events_refuse_change()"
    )
    op.execute(
        "CREATE TRIGGER audit_merkle_nodes_no_truncate BEFORE TRUNCATE ON audit_merkle_nodes "
        "FOR EACH STATEMENT EXECUTE FUNCTION audit_events_refuse_change()"
    )
    # The head row may only move forward through UPDATE; deleting it would stop appends.
    op.execute(
        "CREATE TRIGGER audit_head_no_delete BEFORE DELETE ON audit_head "
        "FOR EACH ROW EXECUTE FUNCTION audit_events_refuse_change()"
    )
    op.execute(
        "CREATE TRIGGER audit_head_no_truncate BEFORE TRUNCATE ON audit_head "
        "FOR EACH STATEMENT EXECUTE FUNCTION audit_events_refuse_change()"
    )
    role = writer_role()
    op.execute(_CREATE_ROLE.format(role=role))
    for table in (*_APPEND_ONLY, "audit_head", "api_keys"):
        op.execute(f"REVOKE ALL ON {table} FROM PUBLIC")
    for table in _APPEND_ONLY:
        op.execute(f"GRANT SELECT, INSERT ON {table} TO {role}")
    op.execute(f"GRANT SELECT, UPDATE (tree_size, head_hash, frontier) ON audit_head TO {role}")
    # Keys are created (INSERT) and revoked (UPDATE of revoked_at only).
    op.execute(f"GRANT SELECT, INSERT ON api_keys TO {role}")
    op.execute(f"GRANT UPDATE (revoked_at) ON api_keys TO {role}")
    op.execute(f"GRANT SELECT ON alembic_version TO {role}")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        role = writer_role()
        for table in (*_APPEND_ONLY, "audit_head", "api_keys", "alembic_version"):
            op.execute(f"REVOKE ALL ON {table} FROM {role}")
    op.drop_table("audit_head")
    op.drop_table("audit_merkle_nodes")
    with op.batch_alter_table("audit_events") as batch:
        batch.drop_column("mac")
