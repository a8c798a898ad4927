"""Removing destroyed data keys from PostgreSQL's files, as far as the connected role may.

Deleting a data key's row does not remove its bytes. The deleted row version stays in its
heap page until VACUUM; a plain VACUUM unlinks it but leaves the bytes in the page's free
space; and the WAL holds the row (its insert, and each full-page image of its page) until the
segment leaves pg_wal. Whoever holds the KEK and those files (a superuser, a copy of the data
directory, a backup) can unwrap the key and decrypt what it protected.

The scrub rewrites the table (``VACUUM FULL``: the new file holds the live rows only, the old
one is truncated at commit), closes the WAL segment and checkpoints, so that the checkpoint
retires every segment written before the rewrite. Then it names what still keeps those bytes:
settings that keep retired segments, replication, transactions old enough to see the deleted
rows, and backups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sqlalchemy as sa

from gateway.db import is_sqlite

# Waiting for the rewrite's exclusive lock queues every data key lookup behind it: bounded.
REWRITE_LOCK_TIMEOUT = "10s"
BACKUPS_NOTE = (
    "base backups, dumps and copies of the data directory taken before this scrub keep the "
    "destroyed keys until they are deleted"
)


class ScrubError(RuntimeError):
    """The scrub could not run to its end (the table stayed locked, the server went away)."""


@dataclass(frozen=True)
class ScrubStep:
    """One statement of the scrub, the query saying whether the current role may run it, and
    who may (for the report)."""

    statement: str
    allowed: str
    who_may: str


STEPS = (
    ScrubStep(
        "VACUUM FULL privacy_data_keys",
        "SELECT pg_has_role(c.relowner, 'USAGE') OR pg_has_role(d.datdba, 'USAGE')"
        " FROM pg_class c, pg_database d"
        " WHERE c.oid = 'privacy_data_keys'::regclass AND d.datname = current_database()",
        "the table's owner, the database's owner or a superuser",
    ),
    ScrubStep(
        "SELECT pg_switch_wal()",
        "SELECT has_function_privilege('pg_switch_wal()', 'EXECUTE')",
        "a superuser or a role granted EXECUTE on pg_switch_wal()",
    ),
    ScrubStep(
        "CHECKPOINT",
        "SELECT pg_has_role('pg_checkpoint', 'USAGE')",
        "a superuser or a member of pg_checkpoint",
    ),
)


@dataclass
class ScrubReport:
    """``scrubbed``: the table was rewritten and the WAL before it retired. ``remaining``: what
    must still happen before no file holds a destroyed key, each a sentence for the operator."""

    scrubbed: bool = False
    remaining: list[str] = field(default_factory=list)


def _refused_steps(connection: sa.Connection) -> list[str]:
    return [
        f"`{step.statement}` (needs {step.who_may})"
        for step in STEPS
        if not connection.execute(sa.text(step.allowed)).scalar()
    ]


def _open_snapshots(connection: sa.Connection) -> int:
    """Transactions of this database holding a snapshot while the table is rewritten: a row
    erased after they began is still visible to them, so the rewrite copies it."""
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND backend_xmin IS NOT NULL"
    )
    return int(connection.execute(sa.text(query)).scalar_one())


def _setting(connection: sa.Connection, name: str) -> str:
    return str(
        connection.execute(sa.text("SELECT current_setting(:name)"), {"name": name}).scalar()
    )


def _wal_keepers(connection: sa.Connection) -> list[str]:
    """What keeps the retired WAL segments, or copies of them, after the checkpoint."""
    found = []
    if _setting(connection, "wal_recycle") == "on":
        found.append(
            "wal_recycle is on: the retired WAL segments were renamed for reuse and keep their "
            "bytes until PostgreSQL writes over them; set wal_recycle = off and scrub again "
            "after the next erasure"
        )
    if _setting(connection, "wal_keep_size") not in ("0", "0MB"):
        found.append("wal_keep_size > 0 keeps older WAL segments in pg_wal: set it to 0")
    if _setting(connection, "archive_mode") != "off":
        found.append("WAL archiving is on: the archived segments must expire from the archive")
    slots = connection.execute(sa.text("SELECT slot_name FROM pg_replication_slots")).scalars()
    for slot in slots:
        found.append(
            f"replication slot {slot} holds WAL back (with hot_standby_feedback, deleted rows "
            "too) and its consumer keeps a copy"
        )
    standbys = connection.execute(sa.text("SELECT count(*) FROM pg_stat_replication")).scalar()
    if standbys:
        found.append(
            f"{standbys} streaming standbys hold their own copies: once each has replayed this "
            "scrub, run CHECKPOINT there too (with the same settings)"
        )
    return found


def scrub_destroyed_keys(db: sa.Engine) -> ScrubReport:
    """Rewrite ``privacy_data_keys`` and retire the WAL written before, if the connected role
    may run every step (none runs otherwise); report what else keeps destroyed keys."""
    if is_sqlite(db):
        return ScrubReport(remaining=["SQLite keeps deleted rows in free pages: not scrubbed"])
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        refused = _refused_steps(connection)
        if refused:
            return ScrubReport(remaining=[f"run {step}" for step in refused] + [BACKUPS_NOTE])
        report = ScrubReport(scrubbed=True)
        if _open_snapshots(connection):
            report.remaining.append(
                "transactions were open while the table was rewritten: rows erased after they "
                "began were copied; scrub again once they have ended"
            )
        connection.execute(sa.text(f"SET lock_timeout = '{REWRITE_LOCK_TIMEOUT}'"))
        try:
            for step in STEPS:
                connection.execute(sa.text(step.statement))
        except sa.exc.OperationalError as exc:
            raise ScrubError(f"scrub stopped at a busy or absent server: {exc}") from exc
        report.remaining += [*_wal_keepers(connection), BACKUPS_NOTE]
    return report
