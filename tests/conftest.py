"""Shared fixtures. ``pg_url``: a fresh, migrated PostgreSQL database per test; ``db_url`` and
``db``: the same store on PostgreSQL and on SQLite, for tests that must pass on both.

The database drivers are imported inside the fixtures: the engine's tests need none of them,
and ``bench/gpu_check.sh`` runs those on a machine that has PyTorch but not the gateway's
dependencies."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

if TYPE_CHECKING:
    import sqlalchemy as sa

# Property tests assert behaviour, not speed: on a busy shared machine hypothesis's default
# 200 ms deadline per example fails tests whose behaviour is right.
settings.register_profile("specgate", deadline=None)
settings.load_profile("specgate")

PG_SERVER = "postgresql://postgres@127.0.0.1:5432"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """Creates a uniquely named database on 127.0.0.1:5432, runs the migrations, yields its
    URL and drops it afterwards (also when connections are still open)."""
    import psycopg
    from psycopg import sql

    from gateway.db import upgrade_database

    name = f"specgate_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{PG_SERVER}/test", autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = f"{PG_SERVER}/{name}"
    try:
        upgrade_database(url)
        yield url
    finally:
        with psycopg.connect(f"{PG_SERVER}/test", autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgresql":
        return str(request.getfixturevalue("pg_url"))
    from gateway.db import upgrade_database

    url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade_database(url)
    return url


@pytest.fixture
def db(db_url: str) -> Iterator[sa.Engine]:
    from gateway.db import make_db_engine

    engine = make_db_engine(db_url)
    yield engine
    engine.dispose()
