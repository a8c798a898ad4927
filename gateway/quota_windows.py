"""Request and token counts per key or team and window, in the database, so that every
replica counts against the same numbers.

A request is admitted in one transaction that locks the rows of every window it is checked
against (``SELECT ... FOR UPDATE`` on PostgreSQL, the write lock of ``BEGIN IMMEDIATE`` on
SQLite), checks them all and counts the request in the minute windows: concurrent admissions
for one key or team, on any number of replicas, are serialised on its rows, so no window
admits more requests than its limit. A request refused by one limit (the team's) counts
against none (the key's).

Tokens are charged when served (``charge``), to the windows current then. A request is
admitted while its windows' charged tokens are below their limits, so a window can end
above its token limit by the tokens of the requests in flight when it reached it, no more.

One row per subject and window kind: a row whose window has passed is reset in place by the
next admission or charge, so the table never grows beyond subjects x 3 rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from gateway.audit.schema import metadata
from gateway.db import write_connection
from gateway.quota_limits import Limits, Window, seconds_left, window_bounds

quota_windows = sa.Table(
    "quota_windows",
    metadata,
    sa.Column("subject", sa.String(120), primary_key=True),
    sa.Column("window", sa.String(8), primary_key=True),
    sa.Column("starts_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("requests", sa.BigInteger, nullable=False),
    sa.Column("tokens", sa.BigInteger, nullable=False),
)

Dimension = Literal["requests", "tokens", "budget"]
Charge = tuple[str, Window]


@dataclass(frozen=True)
class Figure:
    """One limit as the rate-limit headers give it: the limit, what is left, seconds until
    the window resets."""

    limit: int
    remaining: int
    reset_s: int


@dataclass(frozen=True)
class Refusal:
    subject: str
    dimension: Dimension
    limit: int
    reset_s: int


@dataclass(frozen=True)
class Verdict:
    """``requests``/``tokens``: the binding limit of each kind (least left), None where no
    limit of that kind applies. ``charges``: the windows to charge the served tokens to."""

    allowed: bool
    refusal: Refusal | None
    requests: Figure | None
    tokens: Figure | None
    charges: tuple[Charge, ...]


@dataclass
class _Row:
    subject: str
    window: Window
    limits: Limits
    requests: int
    tokens: int
    reset_s: int


def _windows(limits: Limits) -> list[Window]:
    found: list[Window] = []
    if limits.rpm_limit is not None or limits.tpm_limit is not None:
        found.append("minute")
    if limits.token_budget is not None:
        found.append(limits.budget_period)
    return found


def _least(figures: list[Figure]) -> Figure | None:
    return min(figures, key=lambda f: (f.remaining, -f.reset_s), default=None)


class QuotaWindows:
    def __init__(self, db: sa.Engine) -> None:
        self._db = db
        dialect = postgresql if db.dialect.name == "postgresql" else sqlite
        self._insert = dialect.insert

    def admit(self, checks: Sequence[tuple[str, Limits]], now: datetime) -> Verdict:
        """Check one request against each ``(subject, limits)`` and count it where all pass."""
        wanted = sorted({(s, w): lim for s, lim in checks for w in _windows(lim)}.items())
        with write_connection(self._db) as connection, connection.begin():
            rows = self._locked(connection, [key for key, _ in wanted], now)
            found = [
                _Row(s, w, limits, *rows[(s, w)], seconds_left(w, now)) for (s, w), limits in wanted
            ]
            refusal = next((r for r in map(_refusal, found) if r is not None), None)
            if refusal is None:
                for row in found:
                    if row.window == "minute":
                        row.requests += 1
                        self._store(connection, row.subject, row.window, now, requests=row.requests)
        return Verdict(
            allowed=refusal is None,
            refusal=refusal,
            requests=_least(
                [
                    Figure(r.limits.rpm_limit, max(0, r.limits.rpm_limit - r.requests), r.reset_s)
                    for r in found
                    if r.window == "minute" and r.limits.rpm_limit is not None
                ]
            ),
            tokens=_least([figure for row in found for figure in _token_figures(row)]),
            charges=tuple(
                (r.subject, r.window)
                for r in found
                if r.window != "minute" or r.limits.tpm_limit is not None
            ),
        )

    def charge(self, charges: Sequence[Charge], tokens: int, now: datetime) -> None:
        """Add the ``tokens`` a request was served to its windows current at ``now``."""
        if not charges or tokens <= 0:
            return
        with write_connection(self._db) as connection, connection.begin():
            rows = self._locked(connection, sorted(set(charges)), now)
            for (subject, window), (_, used) in sorted(rows.items()):
                self._store(connection, subject, window, now, tokens=used + tokens)

    def counted(self, subject: str, window: Window, now: datetime) -> tuple[int, int]:
        """(requests, tokens) counted in ``subject``'s ``window`` holding ``now``."""
        with self._db.connect() as connection:
            return self._current(connection, [(subject, window)], now)[(subject, window)]

    def _locked(
        self, connection: sa.Connection, keys: list[Charge], now: datetime
    ) -> dict[Charge, tuple[int, int]]:
        """Lock the windows' rows (creating missing ones) and read their counts at ``now``."""
        if not keys:
            return {}
        fresh = [
            {
                "subject": s,
                "window": w,
                "starts_at": window_bounds(w, now)[0],
                "requests": 0,
                "tokens": 0,
            }
            for s, w in keys
        ]
        connection.execute(self._insert(quota_windows).values(fresh).on_conflict_do_nothing())
        return self._current(connection, keys, now, lock=True)

    @staticmethod
    def _current(
        connection: sa.Connection, keys: list[Charge], now: datetime, lock: bool = False
    ) -> dict[Charge, tuple[int, int]]:
        c = quota_windows.c
        query = (
            sa.select(c.subject, c.window, c.starts_at, c.requests, c.tokens)
            .where(sa.tuple_(c.subject, c.window).in_(keys))
            .order_by(c.subject, c.window)
        )
        if lock and connection.dialect.name == "postgresql":
            query = query.with_for_update()
        counts = {key: (0, 0) for key in keys}
        for row in connection.execute(query):
            start = window_bounds(row.window, now)[0]
            if _aware(row.starts_at) >= start:
                counts[(row.subject, row.window)] = (row.requests, row.tokens)
        return counts

    @staticmethod
    def _store(
        connection: sa.Connection, subject: str, window: Window, now: datetime, **counts: int
    ) -> None:
        """Write a row's counts for the window holding ``now`` (the other count is reset
        where the row's window has passed)."""
        c = quota_windows.c
        start = window_bounds(window, now)[0]
        values: dict[str, Any] = {"starts_at": start, **counts}
        for other in {"requests", "tokens"} - counts.keys():
            values[other] = sa.case((c.starts_at < start, 0), else_=c[other])
        connection.execute(
            sa.update(quota_windows)
            .where(c.subject == subject, c.window == window)
            .values(**values)
        )


def _aware(moment: datetime) -> datetime:
    """SQLite gives naive datetimes back; they were written in UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _refusal(row: _Row) -> Refusal | None:
    limits = row.limits
    if row.window == "minute":
        if limits.rpm_limit is not None and row.requests >= limits.rpm_limit:
            return Refusal(row.subject, "requests", limits.rpm_limit, row.reset_s)
        if limits.tpm_limit is not None and row.tokens >= limits.tpm_limit:
            return Refusal(row.subject, "tokens", limits.tpm_limit, row.reset_s)
        return None
    assert limits.token_budget is not None
    if row.tokens >= limits.token_budget:
        return Refusal(row.subject, "budget", limits.token_budget, row.reset_s)
    return None


def _token_figures(row: _Row) -> list[Figure]:
    limit = row.limits.tpm_limit if row.window == "minute" else row.limits.token_budget
    if limit is None:
        return []
    return [Figure(limit, max(0, limit - row.tokens), row.reset_s)]
