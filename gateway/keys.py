"""API keys and roles. Only the SHA-256 of a key is stored; the plaintext is shown once.

A key is ``sg-`` followed by 43 URL-safe characters (256 random bits): far beyond guessing, so
a fast unsalted hash is enough to store it. Every creation, revocation and change of a key's
content storage choice is recorded as a ``key`` audit event in the same transaction as the
change itself.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, get_args

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from gateway.audit.log import AuditLog, AuditUnavailableError
from gateway.audit.schema import api_keys
from gateway.db import execute_first, once_more_if_ended, read_connection, write_connection

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


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class KeyStore:
    def __init__(self, db: sa.Engine, audit: AuditLog) -> None:
        self._db = db
        self._audit = audit

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
        try:
            with write_connection(self._db) as connection, connection.begin():
                connection.execute(
                    sa.insert(api_keys).values(
                        key_id=principal.key_id,
                        name=name,
                        role=role,
                        key_hash=hash_key(plaintext),
                        created_at=datetime.now(UTC),
                        store_content=store_content,
                    )
                )
                self._record(connection, actor, "created", principal)
        except IntegrityError as exc:
            raise KeyStoreError(
                f"an active key named {name!r} (or with that secret) exists"
            ) from exc
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"key store unavailable: {exc}") from exc
        return principal, plaintext

    def revoke(self, key_id_or_name: str, actor: str) -> None:
        active = api_keys.c.revoked_at.is_(None)
        match = sa.or_(api_keys.c.key_id == key_id_or_name, api_keys.c.name == key_id_or_name)
        try:
            with write_connection(self._db) as connection, connection.begin():
                row = connection.execute(sa.select(api_keys).where(active, match)).first()
                if row is None:
                    raise KeyStoreError(f"no active key with id or name {key_id_or_name!r}")
                connection.execute(
                    sa.update(api_keys)
                    .where(api_keys.c.key_id == row.key_id)
                    .values(revoked_at=datetime.now(UTC))
                )
                self._record(
                    connection, actor, "revoked", Principal(row.key_id, row.name, row.role)
                )
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"key store unavailable: {exc}") from exc

    def set_store_content(
        self, key_id_or_name: str, store_content: bool | None, actor: str
    ) -> Principal:
        """Set whether an active key's requests keep their text (None: the server's setting)
        and return the key. Requests authenticated after the commit follow it."""
        active = api_keys.c.revoked_at.is_(None)
        match = sa.or_(api_keys.c.key_id == key_id_or_name, api_keys.c.name == key_id_or_name)
        try:
            with write_connection(self._db) as connection, connection.begin():
                row = connection.execute(sa.select(api_keys).where(active, match)).first()
                if row is None:
                    raise KeyStoreError(f"no active key with id or name {key_id_or_name!r}")
                connection.execute(
                    sa.update(api_keys)
                    .where(api_keys.c.key_id == row.key_id)
                    .values(store_content=store_content)
                )
                key = Principal(row.key_id, row.name, row.role, store_content)
                self._record(connection, actor, "updated", key, always_content=True)
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"key store unavailable: {exc}") from exc
        return key

    def list(self) -> list[Principal]:
        """The active keys, oldest first."""
        keys = api_keys.c
        try:
            with self._db.connect() as connection:
                rows = connection.execute(
                    sa.select(keys.key_id, keys.name, keys.role, keys.store_content)
                    .where(keys.revoked_at.is_(None))
                    .order_by(keys.created_at, keys.key_id)
                )
                return [
                    Principal(row.key_id, row.name, row.role, row.store_content) for row in rows
                ]
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"key store unavailable: {exc}") from exc

    def authenticate(self, plaintext: str) -> Principal | None:
        """The principal of an active key, or None. Raises AuditUnavailableError when the
        database cannot be asked."""
        query = sa.select(
            api_keys.c.key_id, api_keys.c.name, api_keys.c.role, api_keys.c.store_content
        ).where(
            api_keys.c.key_hash == hash_key(plaintext), api_keys.c.revoked_at.is_(None)
        )

        def look_up() -> sa.Row[Any] | None:
            with read_connection(self._db) as connection:
                return execute_first(connection, query).first()

        try:
            row = once_more_if_ended(look_up)
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"key store unavailable: {exc}") from exc
        return Principal(row.key_id, row.name, row.role, row.store_content) if row else None

    def _record(
        self,
        connection: sa.Connection,
        actor: str,
        action: str,
        key: Principal,
        always_content: bool = False,
    ) -> None:
        """The `key` event; ``store_content`` where set (always for a change of it, null
        meaning the server's setting)."""
        payload: dict[str, str | bool | None] = {
            "action": action,
            "key_id": key.key_id,
            "name": key.name,
            "role": key.role,
        }
        if always_content or key.store_content is not None:
            payload["store_content"] = key.store_content
        self._audit.append_in(connection, "key", actor, payload)
