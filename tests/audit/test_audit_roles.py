"""Database roles and the append lock: the gateway's writer role can append but not change
history or switch the triggers off; the append lock is a row lock only the writer role can
take, with a bounded wait; the advisory lock of old stalls nothing."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import sql

from gateway.audit.log import AuditLog, AuditUnavailableError
from gateway.audit.mac import EventMac
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine
from gateway.keys import KeyStore
from gateway.privacy.kek import KeyEncryptionKey
from gateway.privacy.store import PrivacyStore
from tests.api_harness import writer_login

OLD_ADVISORY_LOCK_KEY = int.from_bytes(b"sgaudit!", "big")  # what revision 0001 used
MAC = EventMac(b"r" * 32)
LOCK_TIMEOUT_S = 0.5


def _server(pg_url: str) -> str:
    return pg_url.rsplit("/", 1)[0]


@pytest.fixture
def login_role(pg_url: str) -> Iterator[str]:
    """A login role for a gateway, member of the writer role; yields its database URL."""
    with writer_login(pg_url.rsplit("/", 1)[1]) as url:
        yield url


@pytest.fixture
def signer(tmp_path: Path) -> CheckpointSigner:
    return CheckpointSigner.load_or_create(tmp_path / "signing.pem")


REFUSED_TO_WRITER = [
    "UPDATE audit_events SET actor = 'mallory'",
    "DELETE FROM audit_events",
    "TRUNCATE audit_events",
    "ALTER TABLE audit_events DISABLE TRIGGER ALL",
    "ALTER TABLE audit_events DISABLE TRIGGER audit_events_no_update_delete",
    "SET session_replication_role = replica",
    "UPDATE audit_merkle_nodes SET hash = 'x'",
    "DELETE FROM audit_merkle_nodes",
    "TRUNCATE audit_merkle_nodes",
    "DELETE FROM audit_head",
    "UPDATE audit_head SET legacy_size = 100",
    "DROP TABLE audit_events",
    "ALTER TABLE audit_events OWNER TO CURRENT_USER",
    "UPDATE api_keys SET role = 'admin'",
    "UPDATE api_keys SET key_hash = 'x'",
    "UPDATE privacy_content SET key_ref = 'other'",
    "DELETE FROM privacy_content",
    "TRUNCATE privacy_content",
    "UPDATE privacy_data_keys SET wrapped_key = 'x'",
    "TRUNCATE privacy_data_keys",
    "UPDATE privacy_holds SET subject_ref = 'other'",
]


def test_writer_role_stores_content_erases_and_holds(
    login_role: str, signer: CheckpointSigner, tmp_path: Path
) -> None:
    db = make_db_engine(login_role)
    log = AuditLog(db, signer, MAC, tmp_path / "state.json")
    store = PrivacyStore(db, KeyEncryptionKey(b"k" * 32), log)
    subject = store.subject_ref("user:role-test")
    key = store.data_key(subject)
    event = store.append_with_content("request", "key_a", {"i": 1}, key, "prompt", ["hi"])
    record = log.event(event.event_id)
    assert record is not None and store.read_content(record.payload["content"]) == ["hi"]
    assert store.place_hold(subject, "tests") and store.release_hold(subject, "tests")
    assert store.erase_subject(subject, "tests") == [key.key_ref]
    # The ciphertext went with its key (the foreign key's cascade, as the writer).
    with db.connect() as connection:
        assert connection.exec_driver_sql("SELECT count(*) FROM privacy_content").scalar() == 0
    assert store.expire(1, "tests") == []
    # A key's content storage choice may change (only that column), audited.
    keys = KeyStore(db, log)
    principal, _ = keys.create("app", "writer-made", "tests")
    assert keys.set_store_content(principal.key_id, True, "tests").store_content is True
    assert log.verify().ok
    db.dispose()


def test_writer_role_appends_checkpoints_and_verifies(
    login_role: str, signer: CheckpointSigner, tmp_path: Path
) -> None:
    db = make_db_engine(login_role)
    log = AuditLog(db, signer, MAC, tmp_path / "state.json")
    for i in range(5):
        log.append("request", "key_a", {"i": i})
    log.checkpoint()
    report = log.verify()
    assert (report.ok, report.events_checked) == (True, 6), report.reason
    db.dispose()


@pytest.mark.parametrize("statement", REFUSED_TO_WRITER)
def test_writer_role_cannot_change_history(
    login_role: str, signer: CheckpointSigner, statement: str
) -> None:
    db = make_db_engine(login_role)
    AuditLog(db, signer, MAC).append("request", "key_a", {"i": 1})
    with (
        db.connect() as connection,
        pytest.raises(sa.exc.DBAPIError, match=r"permission denied|must be owner"),
    ):
        connection.exec_driver_sql(statement)
    db.dispose()


def test_a_role_outside_the_writer_role_cannot_take_the_append_lock(pg_url: str) -> None:
    name = f"sgo_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{_server(pg_url)}/test", autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        other = f"postgresql://{name}@127.0.0.1:5432/{pg_url.rsplit('/', 1)[1]}"
        with (
            psycopg.connect(other) as connection,
            pytest.raises(psycopg.errors.InsufficientPrivilege),
        ):
            connection.execute("SELECT * FROM audit_head FOR UPDATE")
    finally:
        with psycopg.connect(f"{_server(pg_url)}/test", autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (name,),
            )
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_the_old_advisory_lock_no_longer_stalls_appends(
    pg_url: str, signer: CheckpointSigner
) -> None:
    db = make_db_engine(pg_url)
    log = AuditLog(db, signer, MAC, lock_timeout_s=LOCK_TIMEOUT_S)
    with psycopg.connect(pg_url) as squatter:
        squatter.execute("SELECT pg_advisory_lock(%s)", (OLD_ADVISORY_LOCK_KEY,))
        started = time.monotonic()
        assert log.append("request", "key_a", {"i": 1}).seq == 1
        assert time.monotonic() - started < LOCK_TIMEOUT_S
    db.dispose()


def test_a_held_append_lock_fails_appends_within_the_bound_then_clears(
    pg_url: str, signer: CheckpointSigner
) -> None:
    db = make_db_engine(pg_url)
    log = AuditLog(db, signer, MAC, lock_timeout_s=LOCK_TIMEOUT_S)
    log.append("request", "key_a", {"i": 0})
    with psycopg.connect(pg_url) as holder:
        holder.execute("SELECT * FROM audit_head FOR UPDATE")  # an idle transaction holds it
        started = time.monotonic()
        with pytest.raises(AuditUnavailableError, match="lock timeout"):
            log.append("request", "key_a", {"i": 1})
        waited = time.monotonic() - started
        assert LOCK_TIMEOUT_S * 0.9 <= waited < LOCK_TIMEOUT_S + 1.5
        # Concurrent callers all fail in bounded time too, none hangs.
        errors: list[BaseException] = []

        def append() -> None:
            try:
                log.append("request", "key_b", {})
            except AuditUnavailableError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=append) for _ in range(4)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert len(errors) == 4
        assert time.monotonic() - started < 4 * (LOCK_TIMEOUT_S + 1.5)
    assert log.append("request", "key_a", {"i": 2}).seq == 2
    db.dispose()


def test_a_held_append_lock_fails_the_ping_within_the_bound(
    pg_url: str, signer: CheckpointSigner
) -> None:
    """The readiness ping takes the append lock (and lets it go): a lock someone holds fails
    it within the lock timeout, as it fails every append."""
    db = make_db_engine(pg_url)
    log = AuditLog(db, signer, MAC, lock_timeout_s=LOCK_TIMEOUT_S)
    assert log.ping()
    with psycopg.connect(pg_url) as holder:
        holder.execute("SELECT * FROM audit_head FOR UPDATE")
        started = time.monotonic()
        assert log.ping() is False
        assert time.monotonic() - started < LOCK_TIMEOUT_S + 1.5
    assert log.ping()
    assert log.append("request", "key_a", {}).seq == 1  # the ping left nothing behind
    db.dispose()
