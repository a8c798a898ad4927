"""API keys and roles. Only the SHA-256 of a key is stored; the plaintext is shown once.

A key is ``sg-`` followed by 43 URL-safe characters (256 random bits): far beyond guessing, so
a fast unsalted hash is enough to store it. Every write of a key row (creation, revocation,
change of its content storage choice, sealing of a row from before row MACs) is recorded as a
``key`` audit event in the same transaction, with the row's new version. A key's role is
fixed at creation: another role is another key (create it, revoke the old one).

Each row carries a MAC under a key the database does not hold, and is checked against its
newest ``key`` event on every lookup (``gateway.key_rows``): a row changed, inserted or put
back by someone who controls the database is refused and raises the tamper alarm.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, get_args

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from gateway.audit.log import AuditLog, AuditUnavailableError, TamperDetectedError
from gateway.audit.schema import api_keys, teams
from gateway.db import execute_first, once_more_if_ended, read_connection, write_connection
from gateway.key_rows import RowSeal, keys_with_newest_event, newest_event, unsealed_row_problem

Role = Literal["app", "auditor", "admin"]
ROLES: tuple[Role, ...] = get_args(Role)
KEY_PREFIX = "sg-"


class KeyStoreError(ValueError):
    """A key operation that cannot be done (unknown key, name in use, bad role or name)."""


@dataclass(frozen=True)
class Principal:
    """``store_content``: this key's requests keep their text (encrypted, erasable) or not;
    None follows the server's ``store_content`` setting. A request's own field wins."""

    key_id: str
    name: str
    role: Role
    store_content: bool | None = None
    team: str | None = None


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class KeyStore:
    def __init__(self, db: sa.Engine, audit: AuditLog) -> None:
        """``audit`` must hold the audit MAC key: key rows are sealed and checked with it."""
        if audit.mac is None:
            raise ValueError("a key store needs the audit MAC key (key rows are sealed with it)")
        self._db = db
        self._audit = audit
        self._seal = RowSeal(audit.mac)
        self._alarmed: set[str] = set()
        self._alarm_lock = threading.Lock()

    def create(
        self,
        role: Role,
        name: str,
        actor: str,
        plaintext: str | None = None,
        store_content: bool | None = None,
    ) -> tuple[Principal, str]:
        """Store a new key (a fresh random one unless ``plaintext`` is given, as for the
        bootstrap admin key) and return it with its plaintext, which is not kept."""
        if role not in ROLES:
            raise KeyStoreError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
        if not name or len(name) > 100 or not name.isprintable():
            raise KeyStoreError("a key name is 1 to 100 printable characters")
        plaintext = plaintext or new_key()
        principal = Principal("key_" + secrets.token_hex(8), name, role, store_content)
        row = {
            "key_id": principal.key_id,
            "name": name,
            "role": role,
            "key_hash": hash_key(plaintext),
            "created_at": datetime.now(UTC),
            "revoked_at": None,
            "store_content": store_content,
            "version": 1,
        }
        try:
            with write_connection(self._db) as connection, connection.begin():
                connection.execute(sa.insert(api_keys).values(**row, row_mac=self._seal.seal(row)))
                self._record(connection, actor, "created", principal, version=1)
        except IntegrityError as exc:
            raise KeyStoreError(
                f"an active key named {name!r} (or with that secret) exists"
            ) from exc
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"key store unavailable: {exc}") from exc
        return principal, plaintext

    def revoke(self, key_id_or_name: str, actor: str) -> None:
        """Revoke an active key; also one whose row fails its check (the answer to an alarm)."""
        try:
            with write_connection(self._db) as connection, connection.begin():
                row = self._active_row(connection, key_id_or_name)
                version = self._rewrite(connection, row, revoked_at=datetime.now(UTC))
                key = Principal(row.key_id, row.name, row.role)
                self._record(connection, actor, "revoked", key, version=version)
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"key store unavailable: {exc}") from exc

    def set_store_content(
        self, key_id_or_name: str, store_content: bool | None, actor: str
    ) -> Principal:
        """Set whether an active key's requests keep their text (None: the server's setting)
        and return the key. Requests authenticated after the commit follow it. A row that
        fails its check is not rewritten (that would seal what the attacker wrote)."""
        problem = None
        try:
            with write_connection(self._db) as connection, connection.begin():
                row = self._active_row(connection, key_id_or_name)
                problem = self._seal.problem(row._mapping, newest_event(row))
                if problem is None:
                    version = self._rewrite(connection, row, store_content=store_content)
                    key = Principal(row.key_id, row.name, row.role, store_content, row.team_id)
                    self._record(
                        connection, actor, "updated", key, version=version, always_content=True
                    )
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"key store unavailable: {exc}") from exc
        if problem is not None:
            self._alarm(row.key_id, problem)
            raise KeyStoreError(f"{problem}: revoke it")
        return key

    def set_team(self, key_id_or_name: str, team: str | None, actor: str) -> Principal:
        """Move an active key into ``team`` (None: out of any), as a `key` event (action
        ``team``) with the row's new version; the team must exist (``gateway.teams``)."""
        problem = None
        try:
            with write_connection(self._db) as connection, connection.begin():
                row = self._active_row(connection, key_id_or_name)
                if (
                    team is not None
                    and connection.execute(
                        sa.select(teams.c.team_id).where(teams.c.team_id == team)
                    ).first()
                    is None
                ):
                    raise KeyStoreError(f"no team named {team!r}")
                problem = self._seal.problem(row._mapping, newest_event(row))
                if problem is None:
                    version = self._rewrite(connection, row, team_id=team)
                    key = Principal(row.key_id, row.name, row.role, row.store_content, team)
                    self._record(connection, actor, "team", key, version=version, team=True)
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"key store unavailable: {exc}") from exc
        if problem is not None:
            self._alarm(row.key_id, problem)
            raise KeyStoreError(f"{problem}: revoke it")
        return key

    def list(self) -> list[Principal]:
        """The active keys, oldest first (as stored: a row that fails its check is listed,
        and refused when used)."""
        keys = api_keys.c
        try:
            with self._db.connect() as connection:
                rows = connection.execute(
                    sa.select(keys.key_id, keys.name, keys.role, keys.store_content, keys.team_id)
                    .where(keys.revoked_at.is_(None))
                    .order_by(keys.created_at, keys.key_id)
                )
                return [
                    Principal(row.key_id, row.name, row.role, row.store_content, row.team_id)
                    for row in rows
                ]
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"key store unavailable: {exc}") from exc

    def authenticate(self, plaintext: str) -> Principal | None:
        """The principal of an active key whose row passes its check, or None. A row that
        fails it raises the tamper alarm (once per key). Raises AuditUnavailableError when
        the database cannot be asked."""
        query = self._with_newest_event().where(
            api_keys.c.key_hash == hash_key(plaintext), api_keys.c.revoked_at.is_(None)
        )

        def look_up() -> sa.Row[Any] | None:
            with read_connection(self._db) as connection:
                return execute_first(connection, query).first()

        try:
            row = once_more_if_ended(look_up)
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"key store unavailable: {exc}") from exc
        if row is None:
            return None
        problem = self._seal.problem(row._mapping, newest_event(row))
        if problem is not None:
            self._alarm(row.key_id, problem)
            return None
        return Principal(row.key_id, row.name, row.role, row.store_content, row.team_id)

    def seal_unsealed(self, actor: str) -> Sequence[str]:
        """Seal the active rows from before row MACs (migration 0006) that agree with their
        newest `key` event, each with a `sealed` key event; raise the alarm for those that do
        not. Returns the sealed key ids. The gateway calls this at start, with its MAC key."""
        unsealed = self._with_newest_event().where(
            api_keys.c.row_mac.is_(None), api_keys.c.revoked_at.is_(None)
        )
        try:
            with self._db.connect() as connection:
                rows = connection.execute(unsealed).all()
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"key store unavailable: {exc}") from exc
        return [row.key_id for row in rows if self._seal_row(row, actor)]

    def _seal_row(self, row: sa.Row[Any], actor: str) -> bool:
        problem = unsealed_row_problem(row._mapping, newest_event(row))
        if problem is not None:
            self._alarm(row.key_id, problem)
            return False
        key = Principal(row.key_id, row.name, row.role, row.store_content)
        try:
            with write_connection(self._db) as connection, connection.begin():
                version = self._rewrite(connection, row)
                self._record(connection, actor, "sealed", key, version=version)
        except KeyStoreError:
            return False  # another gateway sealed it first
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"key store unavailable: {exc}") from exc
        return True

    def _with_newest_event(self) -> sa.Select[Any]:
        return keys_with_newest_event(self._db.dialect.name)

    def _active_row(self, connection: sa.Connection, key_id_or_name: str) -> sa.Row[Any]:
        match = sa.or_(api_keys.c.key_id == key_id_or_name, api_keys.c.name == key_id_or_name)
        query = self._with_newest_event().where(api_keys.c.revoked_at.is_(None), match)
        row = connection.execute(query).first()
        if row is None:
            raise KeyStoreError(f"no active key with id or name {key_id_or_name!r}")
        return row

    def _rewrite(self, connection: sa.Connection, row: sa.Row[Any], **changes: Any) -> int:
        """Write ``changes`` to the row as its next version, sealed; returns that version.
        Only if the row is still at the version read: of two concurrent changes one fails
        rather than both recording the same version."""
        version = row.version + 1
        state = {**row._mapping, **changes, "version": version}
        written = connection.execute(
            sa.update(api_keys)
            .where(api_keys.c.key_id == row.key_id, api_keys.c.version == row.version)
            .values(**changes, version=version, row_mac=self._seal.seal(state))
        )
        if written.rowcount != 1:
            raise KeyStoreError(f"key {row.key_id} was changed meanwhile; try again")
        return version

    def _alarm(self, key_id: str, reason: str) -> None:
        """The tamper alarm for a key row, once per key id in this process (a refused key
        may be retried many times a second)."""
        with self._alarm_lock:
            if key_id in self._alarmed:
                return
            self._alarmed.add(key_id)
        self._audit.raise_alarm(TamperDetectedError(None, reason))

    def _record(
        self,
        connection: sa.Connection,
        actor: str,
        action: str,
        key: Principal,
        version: int,
        always_content: bool = False,
        team: bool = False,
    ) -> None:
        """The `key` event, with the row's new version; ``store_content`` where set (always
        for a change of it, null meaning the server's setting)."""
        payload: dict[str, str | bool | int | None] = {
            "action": action,
            "key_id": key.key_id,
            "name": key.name,
            "role": key.role,
            "version": version,
        }
        if always_content or key.store_content is not None:
            payload["store_content"] = key.store_content
        if team or key.team is not None:
            payload["team"] = key.team
        self._audit.append_in(connection, "key", actor, payload)
