"""Alembic environment. ``gateway.db.upgrade_database`` passes an open connection; plain
``alembic`` use falls back to the ``sqlalchemy.url`` option."""

from __future__ import annotations

from alembic import context

from gateway.db import make_db_engine

config = context.config


def run_migrations() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    db = make_db_engine(config.get_main_option("sqlalchemy.url") or "")
    try:
        with db.connect() as own_connection:
            context.configure(connection=own_connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        db.dispose()


run_migrations()
