"""Database engines and migrations. The same code serves PostgreSQL (production, tests) and
SQLite (the embedded laptop default)."""

from __future__ import annotations

import math
import select
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import make_url

import migrations

T = TypeVar("T")

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


# The table whose exclusive lock serialises `specgate db upgrade` runs on PostgreSQL. It is
# owned by the migrating role and granted to nobody, so no other role can lock it (LOCK TABLE
# and every read need a privilege on it); an advisory lock, which any login role can take,
# would let any database user hold migrations up.
MIGRATION_LOCK_TABLE = "specgate_migration_lock"
# unique_violation, duplicate_object, duplicate_table: what a lost CREATE race raises.
_ALREADY_CREATED = {"23505", "42710", "42P07"}


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
    """An engine for ``url``. On PostgreSQL a pooled connection the server has ended is
    replaced at checkout without a query (``_replace_ended_connections``); with ``timeouts``,
    a connection, statement or lock wait fails instead of hanging (and so does waiting for a
    pooled connection)."""
    parsed = make_url(normalise_url(url))
    if parsed.get_backend_name() != "sqlite":
        bounds: dict[str, Any] = {}
        if timeouts is not None:
            bounds = {"pool_timeout": timeouts.connect_s, "connect_args": timeouts.connect_args()}
        engine = sa.create_engine(parsed, pool_size=10, max_overflow=20, **bounds)
        _replace_ended_connections(engine)
        return engine
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(parsed, connect_args={"timeout": 30.0})
    _manage_sqlite_transactions(engine)
    return engine


def _replace_ended_connections(engine: sa.Engine) -> None:
    """Check a pooled connection at checkout without a round trip: an idle PostgreSQL
    connection has nothing to read, so a readable socket means the server sent its goodbye
    (restart, failover, ``pg_terminate_backend``) or closed it; the pool then replaces it.

    This stands in for ``pool_pre_ping``, which sent a query per checkout (three per request
    on the request path). What it cannot see, a peer gone without closing, a pre-ping could
    not answer in time either: those calls fail on their statement, SQLAlchemy invalidates
    the pool on the disconnect error, and the timeouts bound the wait."""

    @sa.event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        if dbapi_connection.closed or has_input(dbapi_connection.pgconn.socket):
            raise sa.exc.DisconnectionError("the server ended this pooled connection")


def has_input(fd: int) -> bool:
    """Whether ``fd`` has something to read now (an idle connection: the server's goodbye)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))


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


class ConnectionEndedError(sa.exc.SQLAlchemyError):
    """The first statement of a unit of work found its pooled connection ended by the server
    (closed after the checkout check saw it alive): nothing of the work reached the database,
    so it may run once more on a fresh connection (``once_more_if_ended``)."""


def execute_first(connection: sa.Connection, statement: sa.Executable) -> sa.CursorResult[Any]:
    """Execute the first statement of a unit of work (its ``BEGIN`` goes with it); a
    disconnect here raises ConnectionEndedError."""
    try:
        return connection.execute(statement)
    except sa.exc.DBAPIError as exc:
        if exc.connection_invalidated:
            raise ConnectionEndedError(str(exc.orig)) from exc
        raise


def once_more_if_ended(work: Callable[[], T]) -> T:
    """Run ``work``; if its first statement met an ended connection (SQLAlchemy has then
    invalidated the pool's older connections), run it once more. A second failure raises
    the driver's error as SQLAlchemy gave it."""
    try:
        return work()
    except ConnectionEndedError:
        pass
    try:
        return work()
    except ConnectionEndedError as exc:
        cause = exc.__cause__
        raise cause if cause is not None else exc from None


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
    they run in one transaction holding ``MIGRATION_LOCK_TABLE`` exclusively, so concurrent
    upgrades (two pods, a job and a pod) run one after the other instead of racing to create
    the same tables. Raises MigrationFailedError when one fails (a refused adoption, an
    unreachable database, a lock table someone else owns)."""
    db = make_db_engine(url)
    try:
        with db.connect() as connection:
            if connection.dialect.name == "postgresql":
                _lock_migrations(connection)  # opens the transaction alembic then runs in
            config = alembic_config()
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
            connection.commit()
    except Exception as exc:
        # SQLAlchemy's messages run over several lines; the first names the problem.
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise MigrationFailedError(f"database migration failed: {detail}") from exc
    finally:
        db.dispose()


def _lock_migrations(connection: sa.Connection) -> None:
    """Create the lock table if need be, check that this role owns it (a table planted by
    another role would be theirs to lock), then take it exclusively in a new transaction."""
    try:
        connection.exec_driver_sql(f"CREATE TABLE IF NOT EXISTS {MIGRATION_LOCK_TABLE} ()")
        connection.commit()
    except (sa.exc.IntegrityError, sa.exc.ProgrammingError) as exc:
        connection.rollback()
        # A concurrent upgrade created it first: IF NOT EXISTS does not cover that race.
        if getattr(exc.orig, "sqlstate", None) not in _ALREADY_CREATED:
            raise
    owned = connection.exec_driver_sql(
        f"SELECT pg_get_userbyid(relowner) = current_user FROM pg_class "
        f"WHERE oid = '{MIGRATION_LOCK_TABLE}'::regclass"
    ).scalar_one()
    if not owned:
        raise MigrationFailedError(
            f"table {MIGRATION_LOCK_TABLE} belongs to another role; drop it and migrate again"
        )
    connection.exec_driver_sql(f"LOCK TABLE {MIGRATION_LOCK_TABLE} IN ACCESS EXCLUSIVE MODE")
