"""Data keys, encrypted content, erasure, retention and legal holds, each change audited in
the transaction that makes it.

A data key belongs to one data subject (by keyed reference) and one UTC day, so retention
can destroy a subject's old content while the current day's stays. Erasure destroys all of
a subject's keys; retention destroys the keys older than the period. A legal hold on a
subject blocks both, and a blocked erasure is itself recorded.
"""

from __future__ import annotations

import base64
import secrets
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from gateway.audit.canonical import format_timestamp
from gateway.audit.log import ERASURE_KIND, AppendedEvent, AuditLog, AuditUnavailableError
from gateway.db import write_connection
from gateway.privacy.commitments import (
    CommitmentKey,
    ContentUnreadableError,
    DataKey,
    ciphertext_commitment,
)
from gateway.privacy.kek import KekError, KeyEncryptionKey
from gateway.privacy.schema import privacy_content, privacy_data_keys, privacy_holds
from gateway.privacy.scrub import ScrubReport, scrub_destroyed_keys

# AI Act Art. 19 and 26(6) ask for at least six months of logs, DSV Art. 4 for one year: the
# content is kept as long as the longest of them by default.
RETENTION_DAYS_DEFAULT = 365
HOLD_KIND = "legal_hold"


class LegalHoldError(ValueError):
    """The subject is under a legal hold: its content may not be erased."""


@dataclass(frozen=True)
class SealedContent:
    """Content encrypted under a data key and not yet stored: what the content table holds of
    it, and what the durable spool keeps of it while the store is away (never the text)."""

    content_id: str
    key_ref: str
    part: str
    ciphertext: bytes

    @classmethod
    def seal(cls, data_key: DataKey, part: str, value: Any) -> SealedContent:
        content_id = str(uuid.uuid4())
        return cls(content_id, data_key.key_ref, part, data_key.encrypt(content_id, value))

    @property
    def commitment(self) -> dict[str, str]:
        """What the chain records of it (the event's ``content`` field)."""
        return {
            "content_id": self.content_id,
            "ciphertext_sha256": ciphertext_commitment(self.ciphertext),
        }

    def as_json(self) -> dict[str, str]:
        return {
            "content_id": self.content_id,
            "key_ref": self.key_ref,
            "part": self.part,
            "ciphertext": base64.b64encode(self.ciphertext).decode("ascii"),
        }

    @classmethod
    def from_json(cls, data: dict[str, str]) -> SealedContent:
        return cls(
            data["content_id"], data["key_ref"], data["part"], base64.b64decode(data["ciphertext"])
        )


def append_with_content(
    db: sa.Engine,
    audit: AuditLog,
    kind: str,
    actor: str | None,
    payload: dict[str, Any],
    sealed: SealedContent,
) -> AppendedEvent:
    """Store ``sealed`` and append the event (its payload's ``content`` set to the
    ciphertext's commitment) in one transaction: both are committed, or neither.

    Content whose data key was destroyed before this commit (a completion spooled during an
    outage, then erased) is not stored: it could never be read. The event then says so
    (``content.discarded``). A key destroyed by a transaction still in flight makes the
    foreign key refuse the row; the caller's retry then finds the key gone."""
    content = sealed.commitment
    keys = privacy_data_keys.c
    row = sa.select(
        sa.literal(sealed.content_id, sa.String),
        sa.literal(sealed.key_ref, sa.String),
        sa.literal(sealed.part, sa.String),
        sa.literal(sealed.ciphertext, sa.LargeBinary),
        sa.literal(datetime.now(UTC), sa.DateTime(timezone=True)),
    ).where(sa.exists().where(keys.key_ref == sealed.key_ref))
    columns = ["content_id", "key_ref", "part", "ciphertext", "created_at"]
    try:
        with write_connection(db) as connection, connection.begin():
            insert = sa.insert(privacy_content).from_select(columns, row)
            stored = connection.execute(insert.returning(privacy_content.c.content_id))
            if stored.first() is None:
                content = {**content, "discarded": "data key destroyed before it was stored"}
            return audit.append_in(connection, kind, actor, {**payload, "content": content})
    except IntegrityError as exc:
        raise AuditUnavailableError(
            f"content not stored (its key is being destroyed): {exc}"
        ) from (exc)
    except SQLAlchemyError as exc:
        raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc


def content_stored(db: sa.Engine, content_id: str) -> bool:
    """Whether the content row ``content_id`` exists: then the event stored with it was
    committed too (one transaction), whatever its committer heard back."""
    query = sa.select(privacy_content.c.content_id).where(
        privacy_content.c.content_id == content_id
    )
    try:
        with db.connect() as connection:
            return connection.execute(query).first() is not None
    except SQLAlchemyError as exc:
        raise AuditUnavailableError(f"privacy store unavailable: {exc}") from exc


def user_subject(user: str) -> str:
    """The subject id of a request's ``user``."""
    return f"user:{user}"


def key_owner_subject(key_id: str) -> str:
    """The subject id of an API key's owner (requests without ``user``)."""
    return f"key:{key_id}"


def _destroy_keys(connection: sa.Connection, key_refs: list[str]) -> int:
    """Delete the data keys ``key_refs`` and, by the foreign key's cascade, every ciphertext
    row under them (it could never be decrypted again). Returns the number of rows counted
    under them in the same transaction first; a row whose insert was still in flight is
    deleted by the cascade too, uncounted."""
    if not key_refs:
        return 0
    content = privacy_content.c
    count = sa.select(sa.func.count()).select_from(privacy_content)
    deleted = connection.execute(count.where(content.key_ref.in_(key_refs))).scalar_one()
    connection.execute(
        sa.delete(privacy_data_keys).where(privacy_data_keys.c.key_ref.in_(key_refs))
    )
    return int(deleted)


class PrivacyStore:
    def __init__(self, db: sa.Engine, kek: KeyEncryptionKey, audit: AuditLog) -> None:
        self._db = db
        self.kek = kek
        self._audit = audit

    @property
    def deployment_commitments(self) -> CommitmentKey:
        return CommitmentKey(
            self.kek.commitment_key, {"type": "deployment", "kek_id": self.kek.key_id}
        )

    def subject_ref(self, subject: str) -> str:
        return self.kek.subject_ref(subject)

    # --- keys and content -------------------------------------------------------------------

    def data_key(self, subject_ref: str, now: datetime | None = None) -> DataKey:
        """The subject's data key for today, created (and committed) if there is none."""
        now = now or datetime.now(UTC)
        day = now.astimezone(UTC).date().isoformat()
        key_ref = secrets.token_hex(16)
        key = DataKey.generate()
        row = {
            "key_ref": key_ref,
            "subject_ref": subject_ref,
            "day": day,
            "wrapped_key": self.kek.wrap(key, key_ref),
            "created_at": now,
        }
        insert: Any = (postgresql if self._db.dialect.name == "postgresql" else sqlite).insert(
            privacy_data_keys
        )
        try:
            with write_connection(self._db) as connection, connection.begin():
                connection.execute(insert.values(**row).on_conflict_do_nothing())
                found = connection.execute(
                    sa.select(privacy_data_keys.c.key_ref, privacy_data_keys.c.wrapped_key).where(
                        privacy_data_keys.c.subject_ref == subject_ref,
                        privacy_data_keys.c.day == day,
                    )
                ).one()
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"privacy store unavailable: {exc}") from exc
        try:
            return DataKey(found.key_ref, self.kek.unwrap(found.wrapped_key, found.key_ref))
        except KekError as exc:  # another deployment's KEK: refuse (503), never guess
            raise AuditUnavailableError(str(exc)) from exc

    def existing_key(self, key_ref: str) -> DataKey | None:
        """The data key ``key_ref`` if it was not destroyed."""
        try:
            with self._db.connect() as connection:
                wrapped = connection.execute(
                    sa.select(privacy_data_keys.c.wrapped_key).where(
                        privacy_data_keys.c.key_ref == key_ref
                    )
                ).scalar()
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"privacy store unavailable: {exc}") from exc
        return None if wrapped is None else DataKey(key_ref, self.kek.unwrap(wrapped, key_ref))

    def append_with_content(
        self,
        kind: str,
        actor: str | None,
        payload: dict[str, Any],
        data_key: DataKey,
        part: str,
        value: Any,
    ) -> AppendedEvent:
        """Encrypt ``value`` under ``data_key``, store it and append the event in one
        transaction (``append_with_content``)."""
        sealed = SealedContent.seal(data_key, part, value)
        return append_with_content(self._db, self._audit, kind, actor, payload, sealed)

    def read_content(self, content: dict[str, Any]) -> Any:
        """Decrypt stored content named by an event's ``content`` field; checks the ciphertext
        against the chain's commitment. ContentUnreadableError once its key is destroyed."""
        content_id = str(content.get("content_id"))
        if content.get("discarded"):
            raise ContentUnreadableError(f"content {content_id} was erased before it was stored")
        try:
            with self._db.connect() as connection:
                row = connection.execute(
                    sa.select(privacy_content).where(privacy_content.c.content_id == content_id)
                ).first()
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"privacy store unavailable: {exc}") from exc
        if row is None:
            raise ContentUnreadableError(
                f"content {content_id} is not in the content table: erased with its data key "
                "(its ciphertext goes with it), or never stored"
            )
        if ciphertext_commitment(row.ciphertext) != content.get("ciphertext_sha256"):
            raise ContentUnreadableError(f"content {content_id} does not match its commitment")
        try:
            key = self.existing_key(row.key_ref)
        except KekError as exc:
            raise ContentUnreadableError(str(exc)) from exc
        if key is None:
            raise ContentUnreadableError(f"content {content_id} was erased (its key is destroyed)")
        return key.decrypt(content_id, row.ciphertext)

    # --- holds, erasure, retention ---------------------------------------------------------

    def _held(self, connection: sa.Connection, subject_ref: str) -> bool:
        query = sa.select(privacy_holds.c.subject_ref).where(
            privacy_holds.c.subject_ref == subject_ref
        )
        return connection.execute(query).first() is not None

    def place_hold(self, subject_ref: str, actor: str) -> bool:
        """Place a legal hold; False if one is in place already."""
        with write_connection(self._db) as connection, connection.begin():
            if self._held(connection, subject_ref):
                return False
            connection.execute(
                sa.insert(privacy_holds).values(
                    subject_ref=subject_ref, placed_at=datetime.now(UTC)
                )
            )
            self._audit.append_in(
                connection, HOLD_KIND, actor, {"action": "placed", "subject_ref": subject_ref}
            )
        return True

    def release_hold(self, subject_ref: str, actor: str) -> bool:
        """Release a legal hold; False if there was none."""
        with write_connection(self._db) as connection, connection.begin():
            deleted = connection.execute(
                sa.delete(privacy_holds).where(privacy_holds.c.subject_ref == subject_ref)
            ).rowcount
            if not deleted:
                return False
            self._audit.append_in(
                connection, HOLD_KIND, actor, {"action": "released", "subject_ref": subject_ref}
            )
        return True

    def holds(self) -> list[str]:
        with self._db.connect() as connection:
            return list(connection.execute(sa.select(privacy_holds.c.subject_ref)).scalars())

    def erase_subject(self, subject_ref: str, actor: str) -> list[str]:
        """Destroy every data key of the subject; returns the destroyed keys' references.
        Raises LegalHoldError (after recording the refusal) under a legal hold."""
        with write_connection(self._db) as connection, connection.begin():
            held = self._held(connection, subject_ref)
            if held:
                self._audit.append_in(
                    connection,
                    ERASURE_KIND,
                    actor,
                    {
                        "cause": "subject_request",
                        "subject_ref": subject_ref,
                        "outcome": "refused_legal_hold",
                        "key_refs": [],
                    },
                )
            else:
                keys = privacy_data_keys.c
                refs = sorted(
                    connection.execute(
                        sa.select(keys.key_ref).where(keys.subject_ref == subject_ref)
                    ).scalars()
                )
                deleted = _destroy_keys(connection, refs)
                self._audit.append_in(
                    connection,
                    ERASURE_KIND,
                    actor,
                    {
                        "cause": "subject_request",
                        "subject_ref": subject_ref,
                        "outcome": "erased",
                        "key_refs": refs,
                        "content_rows_deleted": deleted,
                    },
                )
        if held:
            raise LegalHoldError("the subject is under a legal hold; nothing was erased")
        return refs

    def scrub(self) -> ScrubReport:
        """Remove destroyed keys from PostgreSQL's files as far as this role may
        (``scrub_destroyed_keys``): deleting a row leaves its bytes there."""
        return scrub_destroyed_keys(self._db)

    def expire(self, retention_days: int, actor: str, now: datetime | None = None) -> list[str]:
        """Destroy the data keys created more than ``retention_days`` ago whose subject is not
        on hold, one ``erasure`` event (cause ``retention``) each; returns their references."""
        now = now or datetime.now(UTC)
        cutoff = now - timedelta(days=retention_days)
        keys = privacy_data_keys.c
        held = sa.select(privacy_holds.c.subject_ref)
        destroyed: list[str] = []
        with write_connection(self._db) as connection, connection.begin():
            expired = connection.execute(
                sa.select(keys.key_ref, keys.created_at)
                .where(keys.created_at < cutoff, keys.subject_ref.not_in(held))
                .order_by(keys.created_at)
            ).all()
            for key_ref, created_at in expired:
                deleted = _destroy_keys(connection, [key_ref])
                self._audit.append_in(
                    connection,
                    ERASURE_KIND,
                    actor,
                    {
                        "cause": "retention",
                        "key_refs": [key_ref],
                        "key_created_at": format_timestamp(created_at),
                        "retention_days": retention_days,
                        "outcome": "erased",
                        "content_rows_deleted": deleted,
                    },
                )
                destroyed.append(key_ref)
        return destroyed

    def destroyed_keys(self, key_refs: set[str]) -> set[str]:
        """Which of ``key_refs`` no longer exist."""
        if not key_refs:
            return set()
        with self._db.connect() as connection:
            alive = set(
                connection.execute(
                    sa.select(privacy_data_keys.c.key_ref).where(
                        privacy_data_keys.c.key_ref.in_(sorted(key_refs))
                    )
                ).scalars()
            )
        return key_refs - alive
