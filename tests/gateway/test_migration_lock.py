"""The lock that serialises `specgate db upgrade` runs is one no other database user can take:
a role without privileges on the database's tables (any login role can open a session and take
any advisory lock) cannot hold a migration up."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from gateway.db import MIGRATION_LOCK_TABLE, upgrade_database
from tests.api_harness import fresh_database

OLD_MIGRATION_ADVISORY_KEY = int.from_bytes(b"sgmigrat", "big")  # the lock used before


@pytest.fixture
def outsider() -> Iterator[str]:
    """A login role with no grants (what PUBLIC may do, nothing more)."""
    name = f"sgx_{uuid.uuid4().hex[:10]}"
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (name,),
            )
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_an_unprivileged_role_cannot_block_an_upgrade(outsider: str) -> None:
    with fresh_database() as (_, url):
        upgrade_database(url)  # the lock table exists from here on
        database = url.rsplit("/", 1)[1]
        with psycopg.connect(f"postgresql://{outsider}@127.0.0.1:5432/{database}") as session:
            session.execute("SELECT pg_advisory_lock(%s)", (OLD_MIGRATION_ADVISORY_KEY,))
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                session.execute(f"LOCK TABLE {MIGRATION_LOCK_TABLE} IN ACCESS SHARE MODE")
            session.rollback()
            session.execute("SELECT pg_advisory_lock(%s)", (OLD_MIGRATION_ADVISORY_KEY,))
            finished = threading.Event()

            def upgrade() -> None:
                upgrade_database(url)
                finished.set()

            thread = threading.Thread(target=upgrade, daemon=True)
            thread.start()
            assert finished.wait(30), "the upgrade waited on a lock an outsider holds"
