"""Database engines and migrations. The same code serves PostgreSQL (production, tests) and
SQLite (the embedded laptop default)."""

from __future__ import annotations

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


def make_db_engine(url: str) -> sa.Engine:
    """An engine for ``url``. ``pool_pre_ping`` lets service resume after the database was away."""
    parsed = make_url(normalise_url(url))
    if parsed.get_backend_name() != "sqlite":
        return sa.create_engine(parsed, pool_pre_ping=True, pool_size=10, max_overflow=20)
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


def alembic_config() -> Config:
    """Alembic configuration pointing at the migration scripts shipped inside the package, so
    that ``specgate db upgrade`` works from any working directory."""
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    return config


class MigrationFailedError(RuntimeError):
    """A migration could not be applied; the message is one line naming the problem."""


def upgrade_database(url: str) -> None:
    """Apply all migrations (``alembic upgrade head``) to the database at ``url``; raises
    MigrationFailedError when one fails (a refused adoption, an unreachable database)."""
    db = make_db_engine(url)
    try:
        with db.connect() as connection:
            config = alembic_config()
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
    except Exception as exc:
        # SQLAlchemy's messages run over several lines; the first names the problem.
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise MigrationFailedError(f"database migration failed: {detail}") from exc
    finally:
        db.dispose()
