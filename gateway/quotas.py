"""Teams and the quotas of keys and teams, kept in the audit log itself.

What a key or team may use is its newest `quota` event (subject ``key:<key id>`` or
``team:<name>``): each change is an audit event by construction, carries the gateway's MAC,
and is chained and signed with the rest of the log. Whoever controls the database cannot
raise a quota by editing a row (there is none), forge an event (its MAC fails: the request
is refused and the tamper alarm raised) or put an older, larger quota back by deleting the
newest event (that rewrites signed history, which the next checkpoint catches). A team is a
``teams`` row and a `team` event; membership is the key's sealed row (``gateway.key_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from gateway.audit.log import AuditLog, AuditUnavailableError, TamperDetectedError, record_from_row
from gateway.audit.schema import audit_events, teams
from gateway.db import read_connection, write_connection
from gateway.quota_limits import Limits

QUOTA_EVENT = "quota"
TEAM_EVENT = "team"
# The subject of a `quota` event, written as migration 0007's index is, so that it applies.
_EVENT_SUBJECT = {
    "postgresql": "(audit_events.payload ->> 'subject')",
    "sqlite": "json_extract(audit_events.payload, '$.subject')",
}


class QuotaError(ValueError):
    """A team or quota change that cannot be made (unknown team, name in use, bad name)."""


class QuotaUnverifiableError(Exception):
    """A subject's newest `quota` event fails its MAC: it was written outside the gateway."""


def key_subject(key_id: str) -> str:
    return f"key:{key_id}"


def team_subject(team: str) -> str:
    return f"team:{team}"


class QuotaStore:
    def __init__(self, db: sa.Engine, audit: AuditLog) -> None:
        if audit.mac is None:
            raise ValueError("a quota store needs the audit MAC key (quota events are checked)")
        self._db = db
        self._audit = audit
        self._mac = audit.mac

    def set(self, subject: str, limits: Limits, actor: str) -> None:
        """Record ``limits`` as ``subject``'s quota (a `quota` event)."""
        self._audit.append(QUOTA_EVENT, actor, {"subject": subject, **limits.as_payload()})

    def create_team(self, name: str, limits: Limits, actor: str) -> None:
        """A new team (a `team` event) with its first quota, in one transaction."""
        if not name or len(name) > 100 or not name.isprintable():
            raise QuotaError("a team name is 1 to 100 printable characters")
        try:
            with write_connection(self._db) as connection, connection.begin():
                connection.execute(
                    sa.insert(teams).values(team_id=name, created_at=datetime.now(UTC))
                )
                self._audit.append_in(
                    connection, TEAM_EVENT, actor, {"action": "created", "name": name}
                )
                payload = {"subject": team_subject(name), **limits.as_payload()}
                self._audit.append_in(connection, QUOTA_EVENT, actor, payload)
        except IntegrityError as exc:
            raise QuotaError(f"a team named {name!r} exists") from exc
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"team store unavailable: {exc}") from exc

    def teams(self) -> list[str]:
        """The teams' names, oldest first."""
        try:
            with self._db.connect() as connection:
                query = sa.select(teams.c.team_id).order_by(teams.c.created_at, teams.c.team_id)
                return list(connection.execute(query).scalars())
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"team store unavailable: {exc}") from exc

    def limits(self, subjects: Sequence[str]) -> dict[str, Limits]:
        """Each subject's quota (no limits where none was set). Raises
        QuotaUnverifiableError, after raising the tamper alarm, where the newest `quota`
        event of one fails its MAC."""
        subject_of: sa.ColumnElement[str] = sa.literal_column(_EVENT_SUBJECT[self._db.dialect.name])
        found: dict[str, Limits] = {}
        try:
            with read_connection(self._db) as connection:
                for subject in subjects:
                    row = connection.execute(
                        sa.select(audit_events)
                        .where(
                            sa.literal_column("audit_events.kind")
                            == sa.literal_column(f"'{QUOTA_EVENT}'"),
                            subject_of == subject,
                        )
                        .order_by(audit_events.c.seq.desc())
                        .limit(1)
                    ).first()
                    found[subject] = Limits() if row is None else self._checked(subject, row)
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"quota store unavailable: {exc}") from exc
        return found

    def _checked(self, subject: str, row: sa.Row[object]) -> Limits:
        record = record_from_row(row)
        if not self._mac.valid(record.canonical_bytes(), record.mac):
            reason = f"{subject}: its newest `quota` event (seq {record.seq}) fails its MAC"
            self._audit.raise_alarm(TamperDetectedError(record.seq, reason))
            raise QuotaUnverifiableError(reason)
        return Limits.from_payload(record.payload)
