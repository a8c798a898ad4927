"""What an erased data key leaves in PostgreSQL's files, read the way an attacker who is a
PostgreSQL superuser and holds the KEK would: the table's pages (pageinspect), the files of the
database's data directory and the WAL segments in pg_wal. Each test runs on a private instance
(the WAL and the data directory are the test's own).

Immediately after erasure the key is recoverable; after the scrub (rewrite, WAL switch,
checkpoint) with wal_recycle off and nothing else keeping WAL, no page or file holds it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from gateway.audit.log import AuditLog
from gateway.audit.mac import EventMac
from gateway.cli import app as specgate_cli
from gateway.db import make_db_engine, upgrade_database
from gateway.privacy.commitments import DataKey, ciphertext_commitment
from gateway.privacy.kek import KeyEncryptionKey
from gateway.privacy.store import PrivacyStore
from tests.pg_instance import PgInstance, running_instance

GATEWAY_ROLE = "gateway_login"
ALICE_PROMPT = "canary-erasure-7f3a Alice Example's diagnosis"
BOB_PROMPT = "canary-erasure-7f3a Bob's question"


@dataclass
class Deployment:
    """A migrated database on a private instance, a gateway's store on it (the writer role),
    the gateway's key files, and a superuser connection for the attacker."""

    instance: PgInstance
    superuser_url: str
    gateway_url: str
    store: PrivacyStore
    kek: KeyEncryptionKey
    key_files: dict[str, str]
    superuser: psycopg.Connection


@contextmanager
def deployment(tmp_path: Path, wal_recycle: str) -> Iterator[Deployment]:
    with running_instance() as instance:
        url = instance.create_database("specgate")
        reload_setting(url, "wal_recycle", wal_recycle)
        with psycopg.connect(url, autocommit=True) as superuser:
            superuser.execute("CREATE EXTENSION pageinspect")
            upgrade_database(url)
            superuser.execute(f"CREATE ROLE {GATEWAY_ROLE} LOGIN IN ROLE specgate_writer")
            gateway_url = url.replace("postgres@", f"{GATEWAY_ROLE}@")
            kek = KeyEncryptionKey.create(tmp_path / "kek")
            mac = EventMac.load_or_create(tmp_path / "mac")
            db = make_db_engine(gateway_url)
            try:
                yield Deployment(
                    instance,
                    url,
                    gateway_url,
                    PrivacyStore(db, kek, AuditLog(db, mac=mac)),
                    kek,
                    {
                        "SPECGATE_PRIVACY_KEK_PATH": str(tmp_path / "kek"),
                        "SPECGATE_AUDIT_MAC_KEY_PATH": str(tmp_path / "mac"),
                    },
                    superuser,
                )
            finally:
                db.dispose()


def store_prompt(store: PrivacyStore, user: str, prompt: str) -> DataKey:
    """Store ``prompt`` under the user's data key; returns the key."""
    key = store.data_key(store.subject_ref(f"user:{user}"))
    store.append_with_content("request", f"key_{user}", {}, key, "prompt", prompt)
    return key


def content_under(superuser: psycopg.Connection, key_ref: str) -> dict[str, str]:
    """The ``content`` field of the event stored with the content under ``key_ref``."""
    query = "SELECT content_id, ciphertext FROM privacy_content WHERE key_ref = %s"
    row = superuser.execute(query, (key_ref,)).fetchone()
    assert row is not None
    return {"content_id": row[0], "ciphertext_sha256": ciphertext_commitment(bytes(row[1]))}


def reload_setting(deployment_url: str, name: str, value: str) -> None:
    """Set a server setting and wait until new sessions see it (the reload is a signal)."""
    with psycopg.connect(deployment_url, autocommit=True) as superuser:
        superuser.execute(f"ALTER SYSTEM SET {name} = '{value}'")
        superuser.execute("SELECT pg_reload_conf()")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with psycopg.connect(deployment_url) as session:
            row = session.execute("SELECT current_setting(%s)", (name,)).fetchone()
        if row is not None and row[0] == value:
            return
        time.sleep(0.05)
    raise AssertionError(f"{name} did not become {value}")


def wrapped_key(superuser: psycopg.Connection, key_ref: str) -> bytes:
    query = "SELECT wrapped_key FROM privacy_data_keys WHERE key_ref = %s"
    row = superuser.execute(query, (key_ref,)).fetchone()
    assert row is not None
    return bytes(row[0])


def cli(deployment: Deployment, *args: str, url: str) -> str:
    env = {**deployment.key_files, "SPECGATE_DATABASE_URL": url}
    result = CliRunner().invoke(specgate_cli, ["privacy", *args], env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.output


# --- the attacker's view -------------------------------------------------------------------


def _varlena(raw: bytes) -> bytes:
    """A varlena attribute's value without its header (1 byte when short, else 4)."""
    return raw[1:] if raw[0] & 1 else raw[4:]


def row_versions(superuser: psycopg.Connection, table: str) -> list[list[bytes]]:
    """Every tuple on the table's pages, dead ones included, as raw attribute bytes."""
    query = (
        "SELECT t_attrs FROM generate_series(0, pg_relation_size(%(t)s::regclass) / 8192 - 1)"
        " AS block, heap_page_item_attrs(get_raw_page(%(t)s::text, block::int), %(t)s::regclass)"
        " WHERE t_attrs IS NOT NULL"
    )
    return [[bytes(a) for a in row[0]] for row in superuser.execute(query, {"t": table})]


def recover_prompt(superuser: psycopg.Connection, kek: KeyEncryptionKey, key_ref: str) -> str:
    """Unwrap the key ``key_ref`` from its row version and decrypt the content rows under it:
    what the attacker does with an erasure event's key reference."""
    name = key_ref.encode()
    keys = [v for v in row_versions(superuser, "privacy_data_keys") if _varlena(v[0]) == name]
    assert keys, f"no row version of data key {key_ref} on the table's pages"
    data_key = DataKey(key_ref, kek.unwrap(_varlena(keys[0][3]), key_ref))
    content = [v for v in row_versions(superuser, "privacy_content") if _varlena(v[1]) == name]
    content_id = _varlena(content[0][0]).decode()
    return str(data_key.decrypt(content_id, _varlena(content[0][3])))


def in_table_pages(superuser: psycopg.Connection, secret: bytes) -> bool:
    """Whether any page of privacy_data_keys holds ``secret`` anywhere, free space included
    (read through the shared buffers: what the next checkpoint writes)."""
    query = (
        "SELECT get_raw_page('privacy_data_keys', block::int) FROM generate_series(0,"
        " pg_relation_size('privacy_data_keys') / 8192 - 1) AS block"
    )
    return any(secret in bytes(page) for (page,) in superuser.execute(query))


def files_holding(directory: Path, secret: bytes) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.is_file() and secret in p.read_bytes())


def database_files_holding(deployment: Deployment, secret: bytes) -> list[str]:
    """The files of the database's directory holding ``secret``, after a checkpoint has
    written the shared buffers out."""
    superuser = deployment.superuser
    superuser.execute("CHECKPOINT")
    query = "SELECT oid FROM pg_database WHERE datname = current_database()"
    oid = superuser.execute(query).fetchone()
    assert oid is not None
    return files_holding(deployment.instance.data / "base" / str(oid[0]), secret)


def wal_holding(deployment: Deployment, secret: bytes) -> list[str]:
    return files_holding(deployment.instance.data / "pg_wal", secret)


# --- the tests -----------------------------------------------------------------------------


def test_erased_key_recoverable_until_scrubbed(tmp_path: Path) -> None:
    with deployment(tmp_path, wal_recycle="off") as d:
        alice_key = store_prompt(d.store, "alice", ALICE_PROMPT)
        bob_content = content_under(d.superuser, store_prompt(d.store, "bob", BOB_PROMPT).key_ref)
        secret = wrapped_key(d.superuser, alice_key.key_ref)

        # Erasure with the gateway's own rights: the writer role may run no step of the scrub.
        output = cli(d, "erase", "--subject", "alice", url=d.gateway_url)
        assert "1 data keys destroyed" in output and "not scrubbed" in output
        assert "remaining: run `VACUUM FULL privacy_data_keys`" in output
        assert recover_prompt(d.superuser, d.kek, alice_key.key_ref) == ALICE_PROMPT
        assert in_table_pages(d.superuser, secret)
        assert wal_holding(d, secret)

        # The scrub by a superuser: no page, no file of the database and no WAL segment holds
        # the wrapped key any more; nothing else keeps WAL here, so only backups remain.
        output = cli(d, "scrub", url=d.superuser_url)
        assert "scrubbed: privacy_data_keys rewritten" in output
        assert [line for line in output.splitlines() if line.startswith("remaining")] == [
            "remaining: base backups, dumps and copies of the data directory taken before this "
            "scrub keep the destroyed keys until they are deleted"
        ]
        with pytest.raises(AssertionError, match="no row version"):
            recover_prompt(d.superuser, d.kek, alice_key.key_ref)
        assert not in_table_pages(d.superuser, secret)
        assert database_files_holding(d, secret) == []
        assert wal_holding(d, secret) == []
        assert d.store.read_content(bob_content) == BOB_PROMPT


def test_plain_vacuum_leaves_the_key_in_free_space(tmp_path: Path) -> None:
    """Why the scrub rewrites the table: VACUUM unlinks the erased row, but the newest row of
    a page lies at the free space's edge and its bytes stay there."""
    with deployment(tmp_path, wal_recycle="off") as d:
        store_prompt(d.store, "bob", BOB_PROMPT)
        alice_key = store_prompt(d.store, "alice", ALICE_PROMPT)
        secret = wrapped_key(d.superuser, alice_key.key_ref)
        d.store.erase_subject(d.store.subject_ref("user:alice"), "cli:test")
        d.superuser.execute("VACUUM privacy_data_keys")
        keys = row_versions(d.superuser, "privacy_data_keys")
        assert all(_varlena(v[0]) != alice_key.key_ref.encode() for v in keys)
        assert in_table_pages(d.superuser, secret)
        assert database_files_holding(d, secret)


def test_recycled_wal_segment_keeps_the_key(tmp_path: Path) -> None:
    """With wal_recycle on (PostgreSQL's default) the checkpoint renames the segment holding
    the key for reuse: the scrub says so, and the key is still in pg_wal."""
    with deployment(tmp_path, wal_recycle="on") as d:
        alice_key = store_prompt(d.store, "alice", ALICE_PROMPT)
        secret = wrapped_key(d.superuser, alice_key.key_ref)
        cli(d, "erase", "--subject", "alice", url=d.gateway_url)
        output = cli(d, "scrub", url=d.superuser_url)
        assert "scrubbed: privacy_data_keys rewritten" in output
        assert "remaining: wal_recycle is on" in output
        assert not in_table_pages(d.superuser, secret)
        assert database_files_holding(d, secret) == []
        query = "SELECT pg_walfile_name(pg_current_wal_lsn())"
        current = d.superuser.execute(query).fetchone()
        assert current is not None
        assert [name for name in wal_holding(d, secret) if name > current[0]]


def test_scrub_reports_what_keeps_wal(tmp_path: Path) -> None:
    with deployment(tmp_path, wal_recycle="off") as d:
        reload_setting(d.superuser_url, "wal_keep_size", "64MB")
        d.superuser.execute("SELECT pg_create_physical_replication_slot('standby_a')")
        engine = make_db_engine(d.superuser_url)
        try:
            report = PrivacyStore(engine, d.kek, AuditLog(engine)).scrub()
        finally:
            engine.dispose()
        assert report.scrubbed
        assert any(line.startswith("wal_keep_size > 0") for line in report.remaining)
        assert any("replication slot standby_a" in line for line in report.remaining)
