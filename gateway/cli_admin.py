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

from gateway.audit.witness import DEFAULT_MAX_CHECKPOINT_AGE_S

if TYPE_CHECKING:
    import sqlalchemy as sa

    from gateway.audit.log import AuditLog
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


class ContentChoice(StrEnum):
    """A key's content storage: on, off, or the server's ``store_content`` setting."""

    on = "on"
    off = "off"
    server = "server"

    @property
    def store_content(self) -> bool | None:
        return None if self is ContentChoice.server else self is ContentChoice.on


def _content_label(store_content: bool | None) -> str:
    return "server setting" if store_content is None else ("on" if store_content else "off")


def _resolve_url(database_url: str | None) -> str:
    if database_url:
        return database_url
    from gateway.settings import load_settings

    return load_settings().database_url


def _cli_actor() -> str:
    return f"cli:{getpass.getuser()}"


@contextmanager
def _key_store(database_url: str | None) -> Iterator[KeyStore]:
    from gateway.keys import KeyStore

    with audited_store(database_url) as (db, audit):
        yield KeyStore(db, audit)


@contextmanager
def audited_store(database_url: str | None) -> Iterator[tuple[sa.Engine, AuditLog]]:
    """The database and an audit log holding the gateway's MAC key, for commands that write
    audited changes; exits with a one-line error where either cannot be had."""
    import sqlalchemy as sa

    from gateway.audit.head_mac import head_mac_problem
    from gateway.audit.log import AuditLog, AuditUnavailableError
    from gateway.audit.mac import EventMac, MacKeyError
    from gateway.db import is_sqlite, make_db_engine, upgrade_database
    from gateway.settings import load_settings

    url = _resolve_url(database_url)
    db = make_db_engine(url)
    try:
        if is_sqlite(db):
            # The embedded store migrates itself, as `specgate serve` does.
            upgrade_database(url)
        # Key events carry the gateway's MAC: without it the gateway reports them as forged.
        # The embedded store shares the gateway's data directory, so the key may start here.
        mac_path = load_settings().audit_mac_key_path
        mac = EventMac.load_or_create(mac_path) if is_sqlite(db) else EventMac.from_file(mac_path)
        with db.connect() as connection:
            problem = head_mac_problem(connection, mac)
        if problem is not None:
            raise MacKeyError(f"{problem} ({mac_path})")
        yield db, AuditLog(db, mac=mac)
    except MacKeyError as error:
        typer.echo(
            f"error: {error}; key events must carry the gateway's MAC: run this where the "
            "gateway's key is readable, or set SPECGATE_AUDIT_MAC_KEY_PATH",
            err=True,
        )
        raise typer.Exit(1) from None
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
    from gateway.db import MigrationFailedError, upgrade_database

    try:
        upgrade_database(_resolve_url(database_url))
    except MigrationFailedError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    typer.echo("database is up to date")


@keys_app.command("create")
def keys_create(
    role: Annotated[RoleChoice, typer.Option(help="What the key may do.")],
    name: Annotated[
        str, typer.Option(help="A name for the key's holder, unique among active keys.")
    ],
    store_content: Annotated[
        bool | None,
        typer.Option(
            "--store-content/--no-store-content",
            help="Keep this key's request text, encrypted and erasable (default: the server's "
            "store_content setting).",
        ),
    ] = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Create a key and print it. It is shown only this once; only its hash is stored."""
    from gateway.keys import KeyStoreError

    try:
        with _key_store(database_url) as store:
            principal, plaintext = store.create(
                role.value, name, _cli_actor(), store_content=store_content
            )
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


@keys_app.command("update")
def keys_update(
    key: Annotated[str, typer.Argument(help="Key id (key_...) or name.")],
    store_content: Annotated[
        ContentChoice,
        typer.Option(
            help="Keep this key's request text, encrypted and erasable: on, off, or follow the "
            "server's store_content setting."
        ),
    ],
    database_url: DatabaseUrl = None,
) -> None:
    """Change an active key's content storage choice (a `key` event, action `updated`)."""
    from gateway.keys import KeyStoreError

    try:
        with _key_store(database_url) as store:
            store.set_store_content(key, store_content.store_content, _cli_actor())
    except KeyStoreError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{key}: content storage {_content_label(store_content.store_content)}")


@keys_app.command("list")
def keys_list(database_url: DatabaseUrl = None) -> None:
    """List the active keys (never their secrets)."""
    from rich.console import Console
    from rich.table import Table

    table = Table("key id", "name", "role", "content storage")
    with _key_store(database_url) as store:
        principals = store.list()
    for principal in principals:
        table.add_row(
            principal.key_id,
            principal.name,
            principal.role,
            _content_label(principal.store_content),
        )
    Console().print(table)


@audit_app.command("verify")
def audit_verify(
    export: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="An export file.")],
    public_key: Annotated[
        Path,
        typer.Option(exists=True, dir_okay=False, help="The gateway's public key (PEM)."),
    ],
    trusted_checkpoint: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="A checkpoint you hold already (from GET /v1/audit/checkpoint, a witness, or "
            "an earlier export): the export's tree must extend it.",
        ),
    ] = None,
    mac_key: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="The audit MAC key: check every event."),
    ] = None,
) -> None:
    """Check an export offline: hashes, chain, sequence, MACs, every signed checkpoint in it
    and consistency with a trusted checkpoint. Exits 1 and names the first bad event when
    anything was changed, added, removed or reordered."""
    from gateway.audit.mac import EventMac, MacKeyError
    from gateway.audit.note import NoteError
    from gateway.audit.verify import trusted_checkpoint_text, verify_export

    try:
        mac = EventMac.from_file(mac_key) if mac_key else None
        trusted = (
            trusted_checkpoint_text(trusted_checkpoint.read_text("utf-8", errors="replace"))
            if trusted_checkpoint
            else None
        )
    except (MacKeyError, NoteError) as exc:
        typer.echo(f"FAILED: {exc}", err=True)
        raise typer.Exit(1) from None
    with export.open("rb") as handle:
        # Undecodable bytes become U+FFFD, which no hash will match.
        lines = (line.decode("utf-8", errors="replace") for line in handle)
        report = verify_export(lines, public_key.read_bytes(), mac=mac, trusted_checkpoint=trusted)
    if report.ok:
        typer.echo(f"OK: {report.events_checked} events verified. {report.reason}")
        return
    where = f"event {report.first_bad_seq}" if report.first_bad_seq is not None else "export"
    typer.echo(
        f"FAILED at {where} after {report.events_checked} good events: {report.reason}", err=True
    )
    raise typer.Exit(1)


@audit_app.command("verify-receipt")
def audit_verify_receipt(
    receipt: Annotated[
        Path,
        typer.Argument(
            exists=True, dir_okay=False, help="A receipt from GET /v1/audit/proof/{event_id}."
        ),
    ],
    public_key: Annotated[
        Path,
        typer.Option(exists=True, dir_okay=False, help="The gateway's public key (PEM)."),
    ],
    leaf_hash: Annotated[
        str | None,
        typer.Option(help="The x-specgate-audit-leaf-hash header the response carried."),
    ] = None,
) -> None:
    """Check offline that a request's audit event is in a tree the gateway signed."""
    import json

    from gateway.audit.receipt import ReceiptError, verify_receipt
    from gateway.audit.signing import PublicKeyError

    try:
        statement = verify_receipt(
            json.loads(receipt.read_text("utf-8")), public_key.read_bytes(), leaf_hash
        )
    except (ReceiptError, PublicKeyError, ValueError) as exc:
        typer.echo(f"FAILED: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"OK: {statement}")


@audit_app.command("witness")
def audit_witness(
    url: Annotated[str, typer.Option(help="The gateway's base URL.")],
    key: Annotated[str, typer.Option(envvar="SPECGATE_AUDITOR_KEY", help="An auditor key.")],
    state: Annotated[
        Path, typer.Option(file_okay=False, help="The witness's own directory (keys, state).")
    ],
    name: Annotated[str, typer.Option(help="The witness key's name.")] = "specgate-witness",
    max_checkpoint_age: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds an event may wait for a checkpoint before the gateway counts as no "
            "longer signing; about three times its checkpoint_interval_s.",
        ),
    ] = DEFAULT_MAX_CHECKPOINT_AGE_S,
) -> None:
    """Check the gateway reports no tamper alarm and signs checkpoints in time, and that the
    latest checkpoint extends the one this witness cosigned last; then cosign and store it
    and hand the cosignature to the gateway. Exits 1 naming a truncation, fork, rewrite,
    gateway_alarm or stale_checkpoint; 2 when the gateway cannot be asked."""
    from gateway.audit.witness import WitnessAlarm, WitnessUnavailable, witness_once

    try:
        result = witness_once(url, key, state, name, max_checkpoint_age)
    except WitnessAlarm as alarm:
        typer.echo(f"ALARM ({alarm.kind}): {alarm}", err=True)
        raise typer.Exit(1) from None
    except WitnessUnavailable as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    since = "first checkpoint" if result.old_size is None else f"from {result.old_size}"
    typer.echo(
        f"OK: cosigned {result.checkpoint.origin} at size {result.checkpoint.size} ({since}); "
        f"gateway: {result.delivered}"
    )


@audit_app.command("clear-alarm")
def audit_clear_alarm(
    evidence: Annotated[
        str, typer.Option(help="What the alarm was resolved on (a ticket, a forensic report).")
    ],
    accept_head: Annotated[
        bool,
        typer.Option(
            help="Accept the database's head in place of the tree the gateway wrote (a loss "
            "that cannot be restored); the replaced tree is recorded."
        ),
    ] = False,
    url: Annotated[
        str | None,
        typer.Option(help="A running gateway's base URL; without it, this gateway's files."),
    ] = None,
    key: Annotated[
        str | None, typer.Option(envvar="SPECGATE_ADMIN_KEY", help="An admin key, with --url.")
    ] = None,
) -> None:
    """End the gateway's standing tamper alarm with an `alarm_cleared` audit event naming the
    evidence: on a running gateway (--url, an admin key), or on a stopped one's own files and
    database (its settings; a gateway whose database no longer extends what it wrote cannot
    start). Exits 1 when the alarm stands (none was raised, or the database still does not
    extend what the gateway wrote), 2 when the gateway or database cannot be reached."""
    import json

    if url is None:
        payload = _clear_alarm_here(evidence, accept_head)
    else:
        payload = _clear_alarm_at(url, key or "", evidence, accept_head)
    typer.echo(json.dumps(payload, indent=2))


def _clear_alarm_at(url: str, key: str, evidence: str, accept_head: bool) -> dict[str, object]:
    from gateway.cli_http import post_to_gateway

    answer: dict[str, object] = post_to_gateway(
        url,
        "/v1/admin/audit/alarm/clear",
        key,
        body={"evidence": evidence, "accept_head": accept_head},
        timeout_s=60,
        exit_codes={409: 1},
    )
    return answer


def _clear_alarm_here(evidence: str, accept_head: bool) -> dict[str, object]:
    from gateway.audit.log import AuditLog, AuditUnavailableError, TamperDetectedError
    from gateway.audit.mac import EventMac
    from gateway.audit.signing import CheckpointSigner
    from gateway.db import make_db_engine, normalise_url
    from gateway.settings import load_settings

    settings = load_settings()
    db = make_db_engine(normalise_url(settings.database_url))
    try:
        audit = AuditLog(
            db,
            CheckpointSigner.load_or_create(settings.signing_key_path, settings.audit_origin),
            EventMac.from_file(settings.audit_mac_key_path),
            state_path=settings.audit_state_path,
        )
        return audit.clear_alarm(evidence, _cli_actor(), accept_head)
    except TamperDetectedError as error:
        typer.echo(f"error: the alarm stands: {error.reason}", err=True)
        raise typer.Exit(1) from None
    except ValueError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    except AuditUnavailableError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    finally:
        db.dispose()
