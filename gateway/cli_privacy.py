"""``specgate privacy``: the key-encryption key, erasure by crypto-shredding, legal holds and
retention, without the server. Each change is recorded in the audit log (MAC'd with the
gateway's key) in the transaction that makes it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gateway.audit.canonical import format_timestamp
from gateway.cli_admin import DatabaseUrl, _cli_actor, _resolve_url, audit_app

if TYPE_CHECKING:
    import sqlalchemy as sa

    from gateway.audit.log import AuditLog
    from gateway.privacy.report import ReportData
    from gateway.privacy.scrub import ScrubReport
    from gateway.privacy.store import PrivacyStore
    from gateway.settings import Settings

privacy_app = typer.Typer(no_args_is_help=True)
kek_app = typer.Typer(no_args_is_help=True)
privacy_app.add_typer(kek_app, name="kek", help="The key-encryption key of the data keys.")

Subject = Annotated[
    str | None, typer.Option("--subject", help="The data subject: the requests' `user`.")
]
KeyOwner = Annotated[
    str | None,
    typer.Option("--key-owner", help="The data subject: the owner of this API key id (key_...)."),
]


def _subject(subject: str | None, key_owner: str | None) -> str:
    from gateway.privacy.store import key_owner_subject, user_subject

    if (subject is None) == (key_owner is None):
        typer.echo("error: name the subject with exactly one of --subject, --key-owner", err=True)
        raise typer.Exit(2)
    return user_subject(subject) if subject is not None else key_owner_subject(str(key_owner))


@contextmanager
def content_stores(
    settings: Settings, database_url: str | None, unreachable: str
) -> Iterator[tuple[sa.Engine, AuditLog, PrivacyStore]]:
    """The database, the audit log (with the gateway's MAC key, checked against the log's
    head) and the privacy store (with its KEK); one-line errors where any cannot be had,
    ``unreachable`` (with ``{detail}``) where the database cannot be read."""
    import sqlalchemy as sa

    from gateway.audit.head_mac import head_mac_problem
    from gateway.audit.log import AuditLog, AuditUnavailableError
    from gateway.audit.mac import EventMac, MacKeyError
    from gateway.db import make_db_engine
    from gateway.privacy.kek import KekError, KeyEncryptionKey
    from gateway.privacy.store import PrivacyStore

    db = make_db_engine(database_url or settings.database_url)
    try:
        mac = EventMac.from_file(settings.audit_mac_key_path)
        with db.connect() as connection:
            problem = head_mac_problem(connection, mac)
        if problem is not None:  # events under another key would read as forged
            raise MacKeyError(f"{problem} ({settings.audit_mac_key_path})")
        kek = KeyEncryptionKey.from_file(settings.privacy_kek_path)
        audit = AuditLog(db, mac=mac)
        yield db, audit, PrivacyStore(db, kek, audit)
    except (MacKeyError, KekError) as error:
        typer.echo(
            f"error: {error}; run this where the gateway's keys are readable "
            "(SPECGATE_AUDIT_MAC_KEY_PATH, SPECGATE_PRIVACY_KEK_PATH)",
            err=True,
        )
        raise typer.Exit(1) from None
    except (sa.exc.SQLAlchemyError, AuditUnavailableError) as error:
        detail = str(getattr(error, "orig", None) or error).splitlines()[0]
        typer.echo(f"error: {unreachable.format(detail=detail)}", err=True)
        raise typer.Exit(2) from None
    finally:
        db.dispose()


@contextmanager
def _privacy_store(database_url: str | None) -> Iterator[PrivacyStore]:
    from gateway.settings import load_settings

    unreachable = "the database is not reachable or not migrated ({detail})"
    with content_stores(load_settings(), database_url, unreachable) as (_db, _audit, store):
        yield store


@kek_app.command("create")
def kek_create(
    path: Annotated[
        Path | None,
        typer.Option(help="Where to write it (default: the gateway's privacy_kek_path)."),
    ] = None,
) -> None:
    """Write a new random KEK (hex, mode 0600). Mount it as a Secret; never overwritten."""
    from gateway.privacy.kek import KekError, KeyEncryptionKey
    from gateway.settings import load_settings

    target = path or load_settings().privacy_kek_path
    try:
        kek = KeyEncryptionKey.create(target)
    except KekError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"created KEK {kek.key_id} at {target}")


@privacy_app.command("erase")
def erase(
    subject: Subject = None, key_owner: KeyOwner = None, database_url: DatabaseUrl = None
) -> None:
    """Crypto-shred a data subject: destroy its data keys, so that nobody can decrypt its
    stored content or confirm a text against its commitments once they are scrubbed from
    PostgreSQL's files too (done here where the URL's role may; `scrub` says what remains).
    Refused under a legal hold."""
    from gateway.privacy.store import LegalHoldError

    with _privacy_store(database_url) as store:
        ref = store.subject_ref(_subject(subject, key_owner))
        try:
            destroyed = store.erase_subject(ref, _cli_actor())
        except LegalHoldError as error:
            typer.echo(f"refused: {error} (subject {ref}; recorded)", err=True)
            raise typer.Exit(1) from None
        typer.echo(f"erased subject {ref}: {len(destroyed)} data keys destroyed")
        _scrub(store)


def _echo_scrub(report: ScrubReport) -> None:
    if report.scrubbed:
        typer.echo("scrubbed: privacy_data_keys rewritten, the WAL written before it retired")
    else:
        typer.echo(
            "not scrubbed: a PostgreSQL superuser holding the KEK can still recover the "
            "destroyed keys from the database's files"
        )
    for step in report.remaining:
        typer.echo(f"remaining: {step}")


def _scrub(store: PrivacyStore) -> bool:
    """Scrub and report; whether the table was rewritten and the WAL before it retired."""
    from gateway.privacy.scrub import ScrubError

    try:
        report = store.scrub()
    except ScrubError as error:
        typer.echo(f"not scrubbed: {error}; run `specgate privacy scrub` again", err=True)
        return False
    _echo_scrub(report)
    return report.scrubbed


@privacy_app.command("scrub")
def scrub(database_url: DatabaseUrl = None) -> None:
    """Remove destroyed data keys from PostgreSQL's files: rewrite the data key table, close
    the WAL segment and checkpoint, then name what still keeps them (settings, standbys,
    archives, backups). Run it with a URL of the table's owner or a superuser; exits 1 when
    nothing could be scrubbed. `erase` runs it too, with its own URL."""
    with _privacy_store(database_url) as store:
        scrubbed = _scrub(store)
    if not scrubbed:
        raise typer.Exit(1)


@privacy_app.command("hold")
def hold(
    subject: Subject = None, key_owner: KeyOwner = None, database_url: DatabaseUrl = None
) -> None:
    """Place a legal hold: the subject's content is neither erased nor expired until released."""
    with _privacy_store(database_url) as store:
        ref = store.subject_ref(_subject(subject, key_owner))
        placed = store.place_hold(ref, _cli_actor())
    typer.echo(f"legal hold {'placed on' if placed else 'already on'} subject {ref}")


@privacy_app.command("release")
def release(
    subject: Subject = None, key_owner: KeyOwner = None, database_url: DatabaseUrl = None
) -> None:
    """Release a legal hold."""
    with _privacy_store(database_url) as store:
        ref = store.subject_ref(_subject(subject, key_owner))
        released = store.release_hold(ref, _cli_actor())
    if not released:
        typer.echo(f"error: subject {ref} is not under a legal hold", err=True)
        raise typer.Exit(1)
    typer.echo(f"legal hold released on subject {ref}")


@privacy_app.command("expire")
def expire(
    days: Annotated[
        int | None, typer.Option(min=1, help="Retention period (default: retention_days).")
    ] = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Destroy the data keys older than the retention period now (the gateway also does this
    every retention_interval_s), one `erasure` event per key; held subjects are skipped."""
    from gateway.settings import load_settings

    period = days or load_settings().retention_days
    with _privacy_store(database_url) as store:
        destroyed = store.expire(period, _cli_actor())
    typer.echo(f"retention {period} days: {len(destroyed)} data keys destroyed")


@audit_app.command("replay")
def audit_replay(
    event_id: Annotated[
        str, typer.Argument(help="The `request` event's id (x-specgate-audit-id).")
    ],
    url: Annotated[str, typer.Option(help="The gateway's base URL.")],
    key: Annotated[
        str, typer.Option(envvar="SPECGATE_AUDITOR_KEY", help="An auditor or admin key.")
    ],
    method: Annotated[
        str | None,
        typer.Option(help="Replay under another method (greedy requests): none, ngram, draft."),
    ] = None,
) -> None:
    """Re-run an audited request on the gateway's loaded models and say whether the
    completion matches its recorded commitment. Exits 1 on no match (naming a changed model
    version or configuration, or the first differing token and its logit gap), 2 when the
    gateway refuses or cannot be asked."""
    import json

    from gateway.cli_http import post_to_gateway

    path = f"/v1/audit/replay/{event_id}"
    params = {"method": method} if method else None
    report = post_to_gateway(url, path, key, params=params, timeout_s=600)
    typer.echo(json.dumps(report, indent=2))
    if not report["replayed"]:
        typer.echo("NO MATCH CLAIMED: " + "; ".join(report["differences"]), err=True)
        raise typer.Exit(1)
    if not report["match"]:
        for choice in report["choices"]:
            for found in choice.get("divergences", []):
                verdict = (
                    "within the dtype's rounding (a near-tie)"
                    if found["within_rounding"]
                    else "BEYOND the dtype's rounding: a bug"
                )
                typer.echo(
                    f"choice {choice['index']}: the {found['output']} output ({found['method']})"
                    f" leaves plain decoding at token {found['position']}, logit gap"
                    f" {found['plain_gap']:.6g} against a bound of {found['bound']:.3g}"
                    f" in {found['dtype']}: {verdict}",
                    err=True,
                )
        typer.echo("MISMATCH", err=True)
        raise typer.Exit(1)
    typer.echo("MATCH: the replayed completion has the recorded commitment")


compliance_app = typer.Typer(no_args_is_help=True)

RecordFile = Annotated[
    Path | None,
    typer.Option(
        "--processing-record",
        help="The operator's record of processing (YAML; default: processing_record_path).",
    ),
]


@compliance_app.command("record")
def compliance_record(file: RecordFile = None, database_url: DatabaseUrl = None) -> None:
    """Record the declared record of processing in the audit log (a `processing_record`
    event with its hash and content), unless the newest such event has the same content."""
    from gateway.db import make_db_engine
    from gateway.settings import load_settings

    settings = load_settings()
    path = file or settings.processing_record_path
    if path is None:
        typer.echo(
            "error: name the file with --processing-record or processing_record_path", err=True
        )
        raise typer.Exit(2)
    db = make_db_engine(_resolve_url(database_url))
    try:
        _record_declared(db, settings.audit_mac_key_path, path)
    finally:
        db.dispose()


def _record_declared(db: sa.Engine, mac_key_path: Path, path: Path) -> None:
    """Append the file's record if it changed; says which version is in force."""
    from gateway.audit.log import AuditLog, AuditUnavailableError
    from gateway.audit.mac import EventMac, MacKeyError
    from gateway.privacy.processing_record import ProcessingRecordError, record_declared

    try:
        audit = AuditLog(db, mac=EventMac.from_file(mac_key_path))
        version, appended = record_declared(audit, db, path, _cli_actor())
    except ProcessingRecordError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    except (MacKeyError, AuditUnavailableError) as error:
        typer.echo(f"error: the record cannot be appended: {error}", err=True)
        raise typer.Exit(1) from None
    state = "recorded as" if appended else "unchanged since"
    typer.echo(f"processing record {state} event {version.seq} ({version.sha256})", err=True)


@compliance_app.command("report")
def compliance_report(
    since: Annotated[datetime, typer.Option(help="Start of the period (UTC unless stated).")],
    until: Annotated[datetime, typer.Option(help="End of the period (exclusive).")],
    out: Annotated[Path | None, typer.Option(help="Write the HTML here (default: stdout).")] = None,
    processing_record: RecordFile = None,
    cosignature_max_age_h: Annotated[
        float | None,
        typer.Option(
            "--cosignature-max-age-hours",
            min=0,
            help="Warn when the newest witness cosignature is older at the period's end "
            "(default: witness_max_age_s, else 24).",
        ),
    ] = None,
    database_url: DatabaseUrl = None,
) -> None:
    """The record of processing activities (revDSG Art. 12, GDPR Art. 30) as one HTML page:
    the declared record (recorded first if the file changed), then the evidence of the
    period from the audit log, with the chain verification (run now, with the gateway's
    keys)."""
    from gateway.db import make_db_engine
    from gateway.privacy.report import COSIGNATURE_MAX_AGE, collect
    from gateway.privacy.report_html import render_html
    from gateway.settings import load_settings

    settings = load_settings()
    record_path = processing_record or settings.processing_record_path
    if cosignature_max_age_h is not None:
        max_age = timedelta(hours=cosignature_max_age_h)
    elif settings.witness_max_age_s is not None:
        max_age = timedelta(seconds=settings.witness_max_age_s)
    else:
        max_age = COSIGNATURE_MAX_AGE
    db = make_db_engine(_resolve_url(database_url))
    try:
        if record_path is not None:
            _record_declared(db, settings.audit_mac_key_path, record_path)
        data = collect(db, since, until, max_age)
        _verify(db, data, settings)
        page = render_html(data)
    finally:
        db.dispose()
    if out is None:
        typer.echo(page)
    else:
        out.write_text(page, "utf-8")
        typer.echo(f"wrote {out} ({data.total_requests} requests)", err=True)


def _verify(db: sa.Engine, data: ReportData, settings: Settings) -> None:
    """Verify the period with the gateway's keys, and record that the report was made."""
    from gateway.audit.log import AuditLog, AuditUnavailableError
    from gateway.audit.mac import EventMac, MacKeyError
    from gateway.audit.signing import CheckpointSigner

    if not settings.signing_key_path.is_file():
        data.verification_note = f"the signing key {settings.signing_key_path} is not here"
        return
    try:
        signer = CheckpointSigner.load_or_create(settings.signing_key_path, settings.audit_origin)
        mac = EventMac.from_file(settings.audit_mac_key_path)
        audit = AuditLog(db, signer, mac=mac, state_path=settings.audit_state_path)
        data.verification = audit.verify(data.since, data.until)
        audit.append(
            "compliance_report",
            _cli_actor(),
            {
                "since": format_timestamp(data.since),
                "until": format_timestamp(data.until),
                "verified": data.verification.ok,
            },
        )
    except (MacKeyError, AuditUnavailableError) as error:
        data.verification_note = str(error)
