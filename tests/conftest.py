"""Shared fixtures. ``pg_url``: a fresh, migrated PostgreSQL database per test; ``db_url`` and
``db``: the same store on PostgreSQL and on SQLite, for tests that must pass on both."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from hypothesis import settings
from psycopg import sql

from gateway.db import make_db_engine, upgrade_database

# Property tests assert behaviour, not speed: on a busy shared machine hypothesis's default
# 200 ms deadline per example fails tests whose behaviour is right.
settings.register_profile("specgate", deadline=None)
settings.load_profile("specgate")

PG_SERVER = "postgresql://postgres@127.0.0.1:5432"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """Creates a uniquely named database on 127.0.0.1:5432, runs the migrations, yields its
    URL and drops it afterwards (also when connections are still open)."""
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
    url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade_database(url)
    return url


@pytest.fixture
def db(db_url: str) -> Iterator[sa.Engine]:
    engine = make_db_engine(db_url)
    yield engine
    engine.dispose()
