"""Migration 0004 on a database that already holds content: rows whose data key an earlier
erasure destroyed are deleted (nobody could decrypt them), the others stay, and from then on
ciphertext goes with its key (the foreign key's cascade), on PostgreSQL and SQLite."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command

from gateway.db import alembic_config, make_db_engine, upgrade_database
from gateway.privacy.schema import privacy_content, privacy_data_keys
from tests.api_harness import PG_SERVER


@pytest.fixture(params=["postgresql", "sqlite"])
def old_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database (not migrated) on PostgreSQL or SQLite."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'old.db'}"
        return
    import psycopg
    from psycopg import sql

    name = f"specgate_e20b_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{PG_SERVER}/test", autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield f"{PG_SERVER}/{name}"
    finally:
        with psycopg.connect(f"{PG_SERVER}/test", autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def _content(content_id: str, key_ref: str) -> dict[str, object]:
    return {
        "content_id": content_id,
        "key_ref": key_ref,
        "part": "prompt",
        "ciphertext": b"\x00" * 40,
        "created_at": datetime.now(UTC),
    }


def _content_ids(db: sa.Engine) -> list[str]:
    with db.connect() as connection:
        query = sa.select(privacy_content.c.content_id).order_by(privacy_content.c.content_id)
        return list(connection.execute(query).scalars())


def test_upgrade_deletes_shredded_ciphertext_and_cascades_from_then_on(old_url: str) -> None:
    db = make_db_engine(old_url)
    config = alembic_config()
    with db.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0003")
        connection.execute(
            sa.insert(privacy_data_keys).values(
                key_ref="a" * 32,
                subject_ref="s" * 32,
                day="2026-12-01",
                wrapped_key=b"w",
                created_at=datetime.now(UTC),
            )
        )
        # One row under a live key, one whose key an erasure before 0004 destroyed.
        connection.execute(
            sa.insert(privacy_content), [_content("live", "a" * 32), _content("shred", "b" * 32)]
        )
    db.dispose()
    upgrade_database(old_url)
    db = make_db_engine(old_url)
    assert _content_ids(db) == ["live"]
    with db.begin() as connection:
        connection.execute(sa.delete(privacy_data_keys))
    assert _content_ids(db) == []
    with pytest.raises(sa.exc.IntegrityError), db.begin() as connection:
        connection.execute(sa.insert(privacy_content).values(**_content("late", "c" * 32)))
    db.dispose()
