"""``specgate teams`` and ``specgate keys quota|team``: teams and quotas without the server,
each change an audit event as through the admin API (``gateway.quotas``)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from gateway.cli_admin import DatabaseUrl, _cli_actor, _key_store, audited_store, keys_app
from gateway.quota_limits import Limits

teams_app = typer.Typer(no_args_is_help=True)


class PeriodChoice(StrEnum):
    day = "day"
    month = "month"


Rpm = Annotated[int | None, typer.Option(min=0, help="Requests per minute (default: none).")]
Tpm = Annotated[
    int | None, typer.Option(min=0, help="Prompt + completion tokens per minute (default: none).")
]
Budget = Annotated[
    int | None, typer.Option(min=0, help="Tokens per budget period (default: none).")
]
PeriodOption = Annotated[PeriodChoice, typer.Option(help="The budget's UTC calendar period.")]


def _limits(
    rpm_limit: int | None, tpm_limit: int | None, token_budget: int | None, period: PeriodChoice
) -> Limits:
    return Limits(rpm_limit, tpm_limit, token_budget, period.value)


def _describe(subject: str, limits: Limits) -> str:
    parts = [
        f"{name}={value}"
        for name, value in limits.as_payload().items()
        if value is not None and (name != "budget_period" or limits.token_budget is not None)
    ]
    return f"{subject}: {', '.join(parts) or 'no limits'}"


@teams_app.command("create")
def teams_create(
    name: Annotated[str, typer.Argument(help="The team's name, unique.")],
    rpm_limit: Rpm = None,
    tpm_limit: Tpm = None,
    token_budget: Budget = None,
    budget_period: PeriodOption = PeriodChoice.day,
    database_url: DatabaseUrl = None,
) -> None:
    """Create a team with its quota (a `team` and a `quota` event)."""
    from gateway.quotas import QuotaError, QuotaStore, team_subject

    limits = _limits(rpm_limit, tpm_limit, token_budget, budget_period)
    try:
        with audited_store(database_url) as (db, audit):
            QuotaStore(db, audit).create_team(name, limits, _cli_actor())
    except QuotaError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"created team {_describe(team_subject(name), limits)}")


@teams_app.command("list")
def teams_list(database_url: DatabaseUrl = None) -> None:
    """The teams and their quotas."""
    from gateway.quotas import QuotaStore, team_subject

    with audited_store(database_url) as (db, audit):
        store = QuotaStore(db, audit)
        subjects = [team_subject(name) for name in store.teams()]
        for subject, limits in store.limits(subjects).items():
            typer.echo(_describe(subject, limits))


@teams_app.command("quota")
def teams_quota(
    name: Annotated[str, typer.Argument(help="The team's name.")],
    rpm_limit: Rpm = None,
    tpm_limit: Tpm = None,
    token_budget: Budget = None,
    budget_period: PeriodOption = PeriodChoice.day,
    database_url: DatabaseUrl = None,
) -> None:
    """Replace a team's quota (a `quota` event); a limit left out is no limit."""
    from gateway.quotas import QuotaStore, team_subject

    limits = _limits(rpm_limit, tpm_limit, token_budget, budget_period)
    with audited_store(database_url) as (db, audit):
        store = QuotaStore(db, audit)
        if name not in store.teams():
            typer.echo(f"error: no team named {name!r}", err=True)
            raise typer.Exit(1)
        store.set(team_subject(name), limits, _cli_actor())
    typer.echo(_describe(team_subject(name), limits))


@keys_app.command("quota")
def keys_quota(
    key: Annotated[str, typer.Argument(help="Key id (key_...) or name.")],
    rpm_limit: Rpm = None,
    tpm_limit: Tpm = None,
    token_budget: Budget = None,
    budget_period: PeriodOption = PeriodChoice.day,
    database_url: DatabaseUrl = None,
) -> None:
    """Replace a key's quota (a `quota` event); a limit left out is no limit."""
    from gateway.quotas import QuotaStore, key_subject

    limits = _limits(rpm_limit, tpm_limit, token_budget, budget_period)
    with audited_store(database_url) as (db, audit):
        from gateway.keys import KeyStore

        found = [p for p in KeyStore(db, audit).list() if key in (p.key_id, p.name)]
        if not found:
            typer.echo(f"error: no active key with id or name {key!r}", err=True)
            raise typer.Exit(1)
        subject = key_subject(found[0].key_id)
        QuotaStore(db, audit).set(subject, limits, _cli_actor())
    typer.echo(_describe(subject, limits))


@keys_app.command("team")
def keys_team(
    key: Annotated[str, typer.Argument(help="Key id (key_...) or name.")],
    team: Annotated[str | None, typer.Option(help="The team; left out: out of any team.")] = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Move a key into a team, or out of any (a `key` event, action `team`)."""
    from gateway.keys import KeyStoreError

    try:
        with _key_store(database_url) as store:
            moved = store.set_team(key, team, _cli_actor())
    except KeyStoreError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{moved.key_id}: team {moved.team or '(none)'}")
