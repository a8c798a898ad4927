"""API keys: stored as hashes only, roles, revocation, every change audited; and the
``specgate keys`` / ``specgate db`` commands."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from gateway.audit.log import AuditLog
from gateway.audit.mac import EventMac
from gateway.audit.schema import api_keys, audit_events
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine
from gateway.keys import KeyStore, KeyStoreError
from tests.audit_helpers import admin_cli

MAC = EventMac(b"k" * 32)


@pytest.fixture
def audit(db: sa.Engine, tmp_path: Path) -> AuditLog:
    return AuditLog(db, CheckpointSigner.load_or_create(tmp_path / "signing.pem"), MAC)


def _key_events(audit: AuditLog) -> list[tuple[str | None, dict[str, str]]]:
    lines = list(audit.export(None, None, "jsonl"))[:-1]
    records = map(json.loads, lines)
    return [(e["actor"], e["payload"]) for e in records if e.get("kind") == "key"]


def test_create_authenticate_revoke_with_audit_trail(db: sa.Engine, audit: AuditLog) -> None:
    store = KeyStore(db, audit)
    principal, plaintext = store.create("auditor", "eve", actor="cli:root")
    assert plaintext.startswith("sg-") and len(plaintext) == 46
    assert principal.role == "auditor" and principal.name == "eve"
    assert store.authenticate(plaintext) == principal
    assert store.authenticate(plaintext + "x") is None
    assert store.list() == [principal]
    with db.connect() as connection:
        stored = connection.execute(sa.select(api_keys.c.key_hash)).scalar_one()
    assert stored == hashlib.sha256(plaintext.encode()).hexdigest()

    store.revoke("eve", actor="cli:root")
    assert store.authenticate(plaintext) is None
    assert store.list() == []
    described = {"key_id": principal.key_id, "name": "eve", "role": "auditor"}
    assert _key_events(audit) == [
        ("cli:root", {"action": "created", **described, "version": 1}),
        ("cli:root", {"action": "revoked", **described, "version": 2}),
    ]
    assert audit.verify().ok


def test_names_are_unique_among_active_keys_only(db: sa.Engine, audit: AuditLog) -> None:
    store = KeyStore(db, audit)
    first, _ = store.create("app", "billing", actor="admin")
    with pytest.raises(KeyStoreError, match="billing"):
        store.create("app", "billing", actor="admin")
    store.revoke(first.key_id, actor="admin")
    second, _ = store.create("app", "billing", actor="admin")
    assert store.list() == [second]
    # The refused duplicate left no audit event behind.
    assert [payload["action"] for _, payload in _key_events(audit)] == [
        "created",
        "revoked",
        "created",
    ]


def test_bootstrap_plaintext_and_bad_input(db: sa.Engine, audit: AuditLog) -> None:
    store = KeyStore(db, audit)
    principal, plaintext = store.create("admin", "helm", actor="startup", plaintext="sg-given")
    assert plaintext == "sg-given"
    assert store.authenticate("sg-given") == principal
    with pytest.raises(KeyStoreError, match="role"):
        store.create("root", "x", actor="a")  # type: ignore[arg-type]
    with pytest.raises(KeyStoreError, match="name"):
        store.create("app", "", actor="a")
    with pytest.raises(KeyStoreError, match="no active key"):
        store.revoke("nobody", actor="a")


def test_keys_cli_refuses_to_write_events_without_the_mac_key(
    pg_url: str, tmp_path: Path
) -> None:
    """An event without the gateway's MAC would read as forged: the CLI refuses to write one."""
    env = {"SPECGATE_DATABASE_URL": pg_url, "SPECGATE_DATA_DIR": str(tmp_path)}
    created = CliRunner().invoke(
        admin_cli(), ["keys", "create", "--role", "app", "--name", "crm"], env=env
    )
    assert created.exit_code == 1
    assert "MAC key" in created.output and "SPECGATE_AUDIT_MAC_KEY_PATH" in created.output


def test_keys_cli_create_list_revoke(db_url: str, db: sa.Engine, tmp_path: Path) -> None:
    cli, runner = admin_cli(), CliRunner()
    mac = EventMac.load_or_create(tmp_path / "audit-mac-key")
    env = {"SPECGATE_DATABASE_URL": db_url, "SPECGATE_DATA_DIR": str(tmp_path)}
    created = runner.invoke(cli, ["keys", "create", "--role", "app", "--name", "crm"], env=env)
    assert created.exit_code == 0, created.output
    plaintext = created.stdout.strip()
    store = KeyStore(db, AuditLog(db, mac=mac))
    principal = store.authenticate(plaintext)
    assert principal is not None and (principal.name, principal.role) == ("crm", "app")

    listed = runner.invoke(cli, ["keys", "list", "--database-url", db_url], env=env)
    assert listed.exit_code == 0
    assert principal.key_id in listed.stdout and "crm" in listed.stdout
    assert plaintext not in listed.stdout

    bad_role = runner.invoke(cli, ["keys", "create", "--role", "root", "--name", "x"], env=env)
    assert bad_role.exit_code == 2

    for choice, stored in (("off", False), ("on", True), ("server", None)):
        updated = runner.invoke(cli, ["keys", "update", "crm", "--store-content", choice], env=env)
        assert updated.exit_code == 0, updated.output
        again_principal = store.authenticate(plaintext)
        assert again_principal is not None and again_principal.store_content is stored
    listed = runner.invoke(cli, ["keys", "list", "--database-url", db_url], env=env)
    assert "server setting" in listed.stdout
    unknown = runner.invoke(cli, ["keys", "update", "nobody", "--store-content", "on"], env=env)
    assert unknown.exit_code == 1 and "no active key" in unknown.output
    with db.connect() as connection:
        changes = [
            payload["store_content"]
            for (payload,) in connection.execute(
                sa.select(audit_events.c.payload)
                .where(audit_events.c.kind == "key")
                .order_by(audit_events.c.seq)
            )
            if payload["action"] == "updated"
        ]
    assert changes == [False, True, None]

    revoked = runner.invoke(cli, ["keys", "revoke", principal.key_id], env=env)
    assert revoked.exit_code == 0
    assert store.authenticate(plaintext) is None
    again = runner.invoke(cli, ["keys", "revoke", principal.key_id], env=env)
    assert again.exit_code == 1
    assert "no active key" in again.output
    assert store.list() == []


def test_db_upgrade_cli_creates_schema_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'fresh' / 'audit.db'}"
    result = CliRunner().invoke(admin_cli(), ["db", "upgrade", "--database-url", url])
    assert result.exit_code == 0, result.output
    engine = make_db_engine(url)
    with engine.connect() as connection:
        tables = set(sa.inspect(connection).get_table_names())
        version = connection.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
    engine.dispose()
    assert {"audit_events", "api_keys", "audit_merkle_nodes", "audit_head"} <= tables
    assert {"privacy_data_keys", "privacy_content", "privacy_holds"} <= tables
    assert {"instance_leases", "teams", "quota_windows"} <= tables
    assert version == "0007"


def test_cli_on_a_fresh_laptop_migrates_sqlite_and_names_missing_postgres_migrations(
    tmp_path: Path, pg_url: str
) -> None:
    from gateway.cli import app

    runner = CliRunner()
    sqlite_url = f"sqlite:///{tmp_path}/fresh.db"
    created = runner.invoke(
        app, ["keys", "create", "--role", "app", "--name", "laptop", "--database-url", sqlite_url]
    )
    assert created.exit_code == 0, created.output
    listed = runner.invoke(app, ["keys", "list", "--database-url", sqlite_url])
    assert "laptop" in listed.output
    bare = pg_url.rsplit("/", 1)[0] + "/postgres"
    refused = runner.invoke(app, ["keys", "list", "--database-url", bare])
    assert refused.exit_code == 2
    assert "specgate db upgrade" in refused.output
