"""``specgate db``, ``specgate keys`` and ``specgate audit``: administration without the server.

Every command that touches the database takes ``--database-url`` (or ``SPECGATE_DATABASE_URL``);
without either it uses the gateway's default (SQLite in the data directory).
"""

from __future__ import annotations

import getpass
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from gateway.keys import KeyStore

db_app = typer.Typer(no_args_is_help=True)
keys_app = typer.Typer(no_args_is_help=True)
audit_app = typer.Typer(no_args_is_help=True)

DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar="SPECGATE_DATABASE_URL",
        help="SQLAlchemy URL, e.g. postgresql://user@host/db (default: SQLite in the data dir).",
    ),
]


class RoleChoice(StrEnum):
    app = "app"
    auditor = "auditor"
    admin = "admin"


def _resolve_url(database_url: str | None) -> str:
    if database_url:
        return database_url
    from gateway.settings import load_settings

    return load_settings().database_url


def _cli_actor() -> str:
    return f"cli:{getpass.getuser()}"


@contextmanager
def _key_store(database_url: str | None) -> Iterator[KeyStore]:
    import sqlalchemy as sa

    from gateway.audit.log import AuditLog, AuditUnavailableError
    from gateway.db import is_sqlite, make_db_engine, upgrade_database
    from gateway.keys import KeyStore

    url = _resolve_url(database_url)
    db = make_db_engine(url)
    try:
        if is_sqlite(db):
            # The embedded store migrates itself, as `specgate serve` does.
            upgrade_database(url)
        yield KeyStore(db, AuditLog(db))
    except (sa.exc.SQLAlchemyError, AuditUnavailableError) as error:
        cause = error.__cause__ or error
        detail = str(getattr(cause, "orig", None) or cause).splitlines()[0]
        typer.echo(
            f"error: the database is not reachable or not migrated ({detail}); "
            "run `specgate db upgrade --database-url ...` first",
            err=True,
        )
        raise typer.Exit(2) from None
    finally:
        db.dispose()


@db_app.command("upgrade")
def db_upgrade(database_url: DatabaseUrl = None) -> None:
    """Create or migrate the database schema to the newest version."""
    from gateway.db import upgrade_database

    upgrade_database(_resolve_url(database_url))
    typer.echo("database is up to date")


@keys_app.command("create")
def keys_create(
    role: Annotated[RoleChoice, typer.Option(help="What the key may do.")],
    name: Annotated[
        str, typer.Option(help="A name for the key's holder, unique among active keys.")
    ],
    database_url: DatabaseUrl = None,
) -> None:
    """Create a key and print it. It is shown only this once; only its hash is stored."""
    from gateway.keys import KeyStoreError

    try:
        with _key_store(database_url) as store:
            principal, plaintext = store.create(role.value, name, _cli_actor())
    except KeyStoreError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"created {principal.role} key {principal.key_id} ({principal.name})", err=True)
    typer.echo(plaintext)


@keys_app.command("revoke")
def keys_revoke(
    key: Annotated[str, typer.Argument(help="Key id (key_...) or name.")],
    database_url: DatabaseUrl = None,
) -> None:
    """Revoke a key: it stops working immediately."""
    from gateway.keys import KeyStoreError

    try:
        with _key_store(database_url) as store:
            store.revoke(key, _cli_actor())
    except KeyStoreError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"revoked {key}")


@keys_app.command("list")
def keys_list(database_url: DatabaseUrl = None) -> None:
    """List the active keys (never their secrets)."""
    from rich.console import Console
    from rich.table import Table

    table = Table("key id", "name", "role")
    with _key_store(database_url) as store:
        principals = store.list()
    for principal in principals:
        table.add_row(principal.key_id, principal.name, principal.role)
    Console().print(table)


@audit_app.command("verify")
def audit_verify(
    export: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="An export file.")],
    public_key: Annotated[
        Path,
        typer.Option(exists=True, dir_okay=False, help="The gateway's public key (PEM)."),
    ],
) -> None:
    """Check an export offline: hashes, chain, sequence and the checkpoint signature. Exits 1
    and names the first bad event when anything was changed, removed or reordered."""
    from gateway.audit.verify import verify_export

    with export.open("rb") as handle:
        # Undecodable bytes become U+FFFD, which no hash will match.
        lines = (line.decode("utf-8", errors="replace") for line in handle)
        report = verify_export(lines, public_key.read_bytes())
    if report.ok:
        typer.echo(f"OK: {report.events_checked} events verified. {report.reason}")
        return
    where = f"event {report.first_bad_seq}" if report.first_bad_seq is not None else "export"
    typer.echo(
        f"FAILED at {where} after {report.events_checked} good events: {report.reason}", err=True
    )
    raise typer.Exit(1)
