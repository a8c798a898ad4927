"""Shared fixtures. ``pg_url``: a fresh, migrated PostgreSQL database per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from gateway.db import upgrade_database

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
