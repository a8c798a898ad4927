"""Database engines and migrations. The same code serves PostgreSQL (production, tests) and
SQLite (the embedded laptop default)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import make_url

import migrations

# Execution option that makes a SQLite transaction take the write lock at BEGIN, so that
# read-then-insert sequences (the hash chain) are serialised across processes too.
SQLITE_IMMEDIATE = "specgate_sqlite_immediate"


def normalise_url(url: str) -> str:
    """Map plain ``postgresql://`` / ``postgres://`` URLs onto the psycopg 3 driver."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def is_sqlite(db: sa.Engine) -> bool:
    return db.dialect.name == "sqlite"


# Key of the session-level advisory lock that serialises `specgate db upgrade` runs.
MIGRATION_LOCK_KEY = int.from_bytes(b"sgmigrat", "big")


@dataclass(frozen=True)
class DatabaseTimeouts:
    """PostgreSQL session bounds: connecting, any one statement, waiting for a lock. The
    client-side bound on a wait (a stopped server answers nothing) is ``gateway.offload``."""

    connect_s: float
    statement_s: float
    lock_s: float

    def connect_args(self) -> dict[str, Any]:
        options = (
            f"-c statement_timeout={round(self.statement_s * 1000)} "
            f"-c lock_timeout={round(self.lock_s * 1000)}"
        )
        return {"connect_timeout": max(1, math.ceil(self.connect_s)), "options": options}


def make_db_engine(url: str, timeouts: DatabaseTimeouts | None = None) -> sa.Engine:
    """An engine for ``url``. ``pool_pre_ping`` lets service resume after the database was away;
    with ``timeouts``, a PostgreSQL connection, statement or lock wait fails instead of hanging
    (and so does waiting for a pooled connection)."""
    parsed = make_url(normalise_url(url))
    if parsed.get_backend_name() != "sqlite":
        if timeouts is None:
            return sa.create_engine(parsed, pool_pre_ping=True, pool_size=10, max_overflow=20)
        return sa.create_engine(
            parsed,
            pool_pre_ping=True,
            pool_size=10,
            max_overflow=20,
            pool_timeout=timeouts.connect_s,
            connect_args=timeouts.connect_args(),
        )
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(parsed, connect_args={"timeout": 30.0})
    _manage_sqlite_transactions(engine)
    return engine


def _manage_sqlite_transactions(engine: sa.Engine) -> None:
    """Let SQLAlchemy, not the sqlite3 module, emit BEGIN, so that writers can ask for
    ``BEGIN IMMEDIATE`` (the recipe from SQLAlchemy's pysqlite documentation)."""

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(connection: sa.Connection) -> None:
        immediate = connection.get_execution_options().get(SQLITE_IMMEDIATE, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def write_connection(db: sa.Engine) -> sa.Connection:
    """A connection whose transactions hold the database's write lock from the start on SQLite
    (on PostgreSQL, writers serialise on the audit_head row lock instead)."""
    return db.connect().execution_options(**{SQLITE_IMMEDIATE: True})


def read_connection(db: sa.Engine) -> sa.Connection:
    """A connection for one read statement on the request path. On PostgreSQL it runs in
    autocommit: psycopg then sends no ``BEGIN`` before the statement and no ``ROLLBACK`` when
    the connection goes back to the pool, two round trips fewer than a transaction (one
    statement reads one consistent snapshot either way). SQLite keeps its transaction."""
    connection = db.connect()
    if is_sqlite(db):
        return connection
    return connection.execution_options(isolation_level="AUTOCOMMIT")


def alembic_config() -> Config:
    """Alembic configuration pointing at the migration scripts shipped inside the package, so
    that ``specgate db upgrade`` works from any working directory."""
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    return config


class MigrationFailedError(RuntimeError):
    """A migration could not be applied; the message is one line naming the problem."""


def upgrade_database(url: str) -> None:
    """Apply all migrations (``alembic upgrade head``) to the database at ``url``. On PostgreSQL
    a session advisory lock is held throughout, so that concurrent upgrades (two pods, a job
    and a pod) run one after the other instead of racing to create the same tables. Raises
    MigrationFailedError when one fails (a refused adoption, an unreachable database)."""
    db = make_db_engine(url)
    try:
        with db.connect() as connection:
            locked = connection.dialect.name == "postgresql"
            if locked:
                connection.execute(sa.select(sa.func.pg_advisory_lock(MIGRATION_LOCK_KEY)))
                connection.commit()
            try:
                config = alembic_config()
                config.attributes["connection"] = connection
                command.upgrade(config, "head")
            finally:
                if locked:
                    connection.rollback()
                    connection.execute(sa.select(sa.func.pg_advisory_unlock(MIGRATION_LOCK_KEY)))
                    connection.commit()
    except Exception as exc:
        # SQLAlchemy's messages run over several lines; the first names the problem.
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise MigrationFailedError(f"database migration failed: {detail}") from exc
    finally:
        db.dispose()
