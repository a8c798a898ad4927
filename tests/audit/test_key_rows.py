"""Key rows against someone with full control of the PostgreSQL database (superuser) who holds
none of the gateway's keys. The gateway runs as a member of the writer role, serves its real
admin and audit routes over HTTP, and the attacker edits ``api_keys`` directly: promoting a
key, minting auditor and admin keys with secrets of their choice (copying a genuine row's MAC
and version), and putting back a key's older row (un-revoking it). Each is refused as an
unknown key would be (401) and raises the tamper alarm once, naming the key.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from fastapi import FastAPI

from gateway.audit.log import AuditLog, TamperDetectedError
from gateway.audit.mac import EventMac
from gateway.audit.schema import api_keys, audit_events
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine
from gateway.errors import install_error_handlers
from gateway.key_cache import KeyCache
from gateway.key_rows import ROW_MAC_LABEL, row_bytes
from gateway.keys import KeyStore, KeyStoreError, hash_key
from gateway.offload import Offload
from gateway.routes import admin as admin_routes
from gateway.routes import audit as audit_routes
from tests.api_harness import writer_login
from tests.audit.test_audit_tamper import rewrite
from tests.audit_helpers import serve

MAC = EventMac(b"g" * 32)
ATTACKER_SECRET = "sg-" + "m" * 43  # the attacker's own key, whose hash they store
CACHE_TTL_S = 60.0


@dataclass
class Gateway:
    audit: AuditLog
    keys: KeyStore
    attacker: sa.Engine  # the database superuser
    url: str
    clock: list[float]  # the key cache's clock, moved by the test

    def get(self, path: str, key: str) -> httpx.Response:
        return httpx.get(self.url + path, headers={"authorization": f"Bearer {key}"})

    def create_key(self, key: str, name: str) -> httpx.Response:
        return httpx.post(
            self.url + "/v1/admin/keys",
            json={"role": "admin", "name": name},
            headers={"authorization": f"Bearer {key}"},
        )


@pytest.fixture
def writer_url(pg_url: str) -> Iterator[str]:
    """A login role in the writer role (what the gateway runs as); yields its database URL."""
    with writer_login(pg_url.rsplit("/", 1)[1]) as url:
        yield url


def _app(audit: AuditLog, keys: KeyStore, cache: KeyCache) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(admin_routes.router)
    app.include_router(audit_routes.router)
    offload = Offload(db_threads=2, prepare_threads=1, timeout_s=5.0)
    app.state.services = SimpleNamespace(audit=audit, keys=keys, offload=offload, key_cache=cache)
    return app


@pytest.fixture
def gateway(pg_url: str, writer_url: str, tmp_path: Path) -> Iterator[Gateway]:
    db, attacker = make_db_engine(writer_url), make_db_engine(pg_url)
    signer = CheckpointSigner.load_or_create(tmp_path / "signing.pem")
    audit = AuditLog(db, signer, MAC, tmp_path / "state.json")
    keys = KeyStore(db, audit)
    clock = [0.0]
    cache = KeyCache(CACHE_TTL_S, clock=lambda: clock[0])
    with serve(_app(audit, keys, cache)) as url:
        yield Gateway(audit, keys, attacker, url, clock)
    db.dispose()
    attacker.dispose()


# --- what the attacker does ----------------------------------------------------------------


def _row(attacker: sa.Engine, key_id: str) -> dict[str, Any]:
    with attacker.connect() as connection:
        row = connection.execute(sa.select(api_keys).where(api_keys.c.key_id == key_id)).one()
    return dict(row._mapping)


def promote(attacker: sa.Engine, key_id: str) -> None:
    with attacker.begin() as connection:
        connection.execute(
            sa.update(api_keys).where(api_keys.c.key_id == key_id).values(role="admin")
        )


def mint(attacker: sa.Engine, genuine_key_id: str, role: str) -> str:
    """Insert a key of ``role`` whose secret the attacker chose, copying every other column
    (the MAC among them) from a genuine row; returns its key id."""
    minted = {
        **_row(attacker, genuine_key_id),
        "key_id": f"key_{role}0000minted",
        "name": f"minted-{role}",
        "role": role,
        "key_hash": hashlib.sha256(ATTACKER_SECRET.encode()).hexdigest(),
    }
    with attacker.begin() as connection:
        connection.execute(sa.insert(api_keys).values(**minted))
    return str(minted["key_id"])


def put_back(attacker: sa.Engine, row: dict[str, Any]) -> None:
    """Restore a row as it was earlier (every column, its MAC included)."""
    with attacker.begin() as connection:
        connection.execute(
            sa.update(api_keys).where(api_keys.c.key_id == row["key_id"]).values(**row)
        )


# --- who notices ---------------------------------------------------------------------------


def alarms(gateway: Gateway) -> list[str]:
    with gateway.attacker.connect() as connection:
        rows = connection.execute(
            sa.select(audit_events.c.payload)
            .where(audit_events.c.kind == "tamper_detected")
            .order_by(audit_events.c.seq)
        )
        return [row.payload["reason"] for row in rows]


def assert_refused_with_one_alarm(gateway: Gateway, key_id: str, request: Any) -> None:
    """``request`` (called twice) is answered 401 as for an unknown key; one alarm names the
    key, the second attempt raises none."""
    for _ in range(2):
        response = request()
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert gateway.audit.tamper is not None and key_id in gateway.audit.tamper.reason
    assert not gateway.audit.integrity_ok()
    reasons = alarms(gateway)
    assert len(reasons) == 1 and key_id in reasons[0], reasons


def test_a_promoted_app_key_cannot_create_keys(gateway: Gateway) -> None:
    app, plaintext = gateway.keys.create("app", "crm", "tests")
    promote(gateway.attacker, app.key_id)
    assert_refused_with_one_alarm(
        gateway, app.key_id, lambda: gateway.create_key(plaintext, "mallory")
    )
    assert "mallory" not in [key.name for key in gateway.keys.list()]


def test_a_database_minted_auditor_key_cannot_export(gateway: Gateway) -> None:
    genuine, _ = gateway.keys.create("auditor", "compliance", "tests")
    minted = mint(gateway.attacker, genuine.key_id, "auditor")
    assert_refused_with_one_alarm(
        gateway, minted, lambda: gateway.get("/v1/audit/export", ATTACKER_SECRET)
    )


def test_a_database_minted_admin_key_cannot_create_keys(gateway: Gateway) -> None:
    genuine, _ = gateway.keys.create("admin", "ops", "tests")
    minted = mint(gateway.attacker, genuine.key_id, "admin")
    assert_refused_with_one_alarm(
        gateway, minted, lambda: gateway.create_key(ATTACKER_SECRET, "mallory")
    )
    assert "mallory" not in [key.name for key in gateway.keys.list()]


def test_an_unrevoked_key_stays_revoked(gateway: Gateway) -> None:
    auditor, plaintext = gateway.keys.create("auditor", "compliance", "tests")
    before = _row(gateway.attacker, auditor.key_id)
    gateway.keys.revoke(auditor.key_id, "tests")
    put_back(gateway.attacker, before)
    assert_refused_with_one_alarm(
        gateway, auditor.key_id, lambda: gateway.get("/v1/audit/export", plaintext)
    )


def test_an_unrevoke_with_the_revocation_event_edited_to_match_is_refused(
    gateway: Gateway,
) -> None:
    auditor, plaintext = gateway.keys.create("auditor", "compliance", "tests")
    before = _row(gateway.attacker, auditor.key_id)
    gateway.keys.revoke(auditor.key_id, "tests")
    put_back(gateway.attacker, before)
    revocation = _events(gateway, "key")[1]["payload"]  # the revocation, made to agree
    with gateway.attacker.begin() as connection:
        connection.exec_driver_sql("ALTER TABLE audit_events DISABLE TRIGGER ALL")
        connection.execute(
            sa.update(audit_events)
            .where(audit_events.c.seq == 2)
            .values(payload={**revocation, "action": "created", "version": 1})
        )
        connection.exec_driver_sql("ALTER TABLE audit_events ENABLE TRIGGER ALL")
    assert_refused_with_one_alarm(
        gateway, auditor.key_id, lambda: gateway.get("/v1/audit/export", plaintext)
    )
    assert "fails its MAC" in alarms(gateway)[0]


def test_an_older_content_choice_cannot_be_put_back(gateway: Gateway) -> None:
    app, plaintext = gateway.keys.create("app", "crm", "tests", store_content=True)
    before = _row(gateway.attacker, app.key_id)
    gateway.keys.set_store_content(app.key_id, False, "tests")
    put_back(gateway.attacker, before)
    assert gateway.keys.authenticate(plaintext) is None
    assert gateway.keys.authenticate(plaintext) is None
    assert gateway.audit.tamper is not None and app.key_id in gateway.audit.tamper.reason
    assert len(alarms(gateway)) == 1


def test_a_changed_row_is_not_sealed_again_by_an_update_but_can_be_revoked(
    gateway: Gateway,
) -> None:
    app, plaintext = gateway.keys.create("app", "crm", "tests")
    promote(gateway.attacker, app.key_id)
    with pytest.raises(KeyStoreError, match=app.key_id):
        gateway.keys.set_store_content(app.key_id, True, "tests")
    assert gateway.keys.authenticate(plaintext) is None
    assert len(alarms(gateway)) == 1
    gateway.keys.revoke(app.key_id, "tests")
    assert gateway.keys.list() == []


def test_the_key_cache_holds_only_verified_rows(gateway: Gateway) -> None:
    """A key the gateway checked and cached keeps what was checked (its app role) until the
    entry expires; its next lookup reads the promoted row and refuses it."""
    app, plaintext = gateway.keys.create("app", "crm", "tests")
    assert gateway.create_key(plaintext, "mallory").status_code == 403  # checked, cached
    promote(gateway.attacker, app.key_id)
    assert gateway.create_key(plaintext, "mallory").status_code == 403  # the cached app role
    assert gateway.audit.tamper is None
    gateway.clock[0] += CACHE_TTL_S
    assert_refused_with_one_alarm(
        gateway, app.key_id, lambda: gateway.create_key(plaintext, "mallory")
    )


def test_an_unrevoke_that_also_removes_the_revocation_event_fails_the_next_checkpoint(
    gateway: Gateway,
) -> None:
    """The attacker's last resort: delete the revocation's `key` event too (and recompute the
    chain and tree). The key's newest event then agrees with the row put back, so the key
    authenticates again, until the next checkpoint finds that the log no longer extends the
    one signed after the revocation and raises the alarm: the detection bound of this attack
    is the checkpoint interval."""
    auditor, plaintext = gateway.keys.create("auditor", "compliance", "tests")
    before = _row(gateway.attacker, auditor.key_id)
    gateway.keys.revoke(auditor.key_id, "tests")
    gateway.audit.checkpoint()  # the periodic checkpoint after the revocation
    put_back(gateway.attacker, before)
    rewrite(gateway.attacker, lambda events: [events[0], *events[2:]])
    assert gateway.keys.authenticate(plaintext) is not None
    with pytest.raises(TamperDetectedError) as raised:
        gateway.audit.checkpoint()
    assert raised.value.first_bad_seq == 2
    assert not gateway.audit.integrity_ok()


def _specgate(args: list[str], mac_key: Path, data: Path) -> subprocess.CompletedProcess[str]:
    """The installed ``specgate`` command, run as an operator would."""
    env = {
        **os.environ,
        "SPECGATE_AUDIT_MAC_KEY_PATH": str(mac_key),
        "SPECGATE_DATA_DIR": str(data),
    }
    command = [str(Path(sys.executable).parent / "specgate"), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_keys_cli_with_another_deployments_mac_key_writes_nothing(
    pg_url: str, tmp_path: Path
) -> None:
    """A key event MAC'd with the wrong key would make every later check report tampering:
    the CLI checks its key against the newest event's MAC first and refuses to write."""
    ours, theirs = tmp_path / "ours.key", tmp_path / "theirs.key"
    mac = EventMac.load_or_create(ours)
    EventMac.load_or_create(theirs)
    db = make_db_engine(pg_url)
    audit = AuditLog(db, mac=mac)
    KeyStore(db, audit).create("admin", "ops", "tests")
    size = audit.head()[0]
    create = ["keys", "create", "--role", "app", "--name", "crm", "--database-url", pg_url]

    refused = _specgate(create, theirs, tmp_path)
    assert refused.returncode == 1, refused.stderr
    assert refused.stdout == ""
    (line,) = refused.stderr.splitlines()
    assert "MAC key" in line and "newest audit event" in line
    assert audit.head()[0] == size
    assert [key.name for key in KeyStore(db, audit).list()] == ["ops"]

    created = _specgate(create, ours, tmp_path)
    assert created.returncode == 0, created.stderr
    assert KeyStore(db, audit).authenticate(created.stdout.strip()) is not None
    db.dispose()


def _legacy_key(gateway: Gateway, name: str, role: str, event_role: str) -> tuple[str, str]:
    """A row and its `created` event as revision 0005 left them (no MAC, version 0, an event
    without a version); the event may say another role than the row. Returns (id, secret)."""
    key_id, plaintext = f"key_legacy_{name}", f"sg-legacy-{name}"
    row = {"key_id": key_id, "name": name, "role": role, "key_hash": hash_key(plaintext)}
    with gateway.attacker.begin() as connection:
        connection.execute(sa.insert(api_keys).values(**row, created_at=datetime.now(UTC)))
    created = {"action": "created", "key_id": key_id, "name": name, "role": event_role}
    gateway.audit.append("key", "cli:root", created)
    return key_id, plaintext


def test_rows_from_before_row_macs_are_sealed_once_if_the_log_agrees(gateway: Gateway) -> None:
    kept, kept_secret = _legacy_key(gateway, "crm", "app", "app")
    promoted, promoted_secret = _legacy_key(gateway, "ops", "admin", "app")
    # A key from after row MACs whose MAC the attacker removed, hoping to have it sealed.
    stripped, stripped_secret = gateway.keys.create("app", "billing", "tests")
    with gateway.attacker.begin() as connection:
        connection.execute(
            sa.update(api_keys)
            .where(api_keys.c.key_id == stripped.key_id)
            .values(role="admin", version=0, row_mac=None)
        )

    assert gateway.keys.seal_unsealed("specgate") == [kept]
    assert gateway.keys.seal_unsealed("specgate") == []
    principal = gateway.keys.authenticate(kept_secret)
    assert principal is not None and (principal.name, principal.role) == ("crm", "app")
    sealed = [
        event["payload"]
        for event in _events(gateway, "key")
        if event["payload"]["action"] == "sealed"
    ]
    assert sealed == [
        {"action": "sealed", "key_id": kept, "name": "crm", "role": "app", "version": 1}
    ]
    assert gateway.keys.authenticate(promoted_secret) is None
    assert gateway.keys.authenticate(stripped_secret) is None
    # The alarm, raised at sealing, names the first refused row (a second while it stands
    # is logged only); using the rows later raises none again.
    (reason,) = alarms(gateway)
    assert promoted in reason or stripped.key_id in reason


def test_every_key_change_is_a_versioned_key_event(gateway: Gateway) -> None:
    """Creation, content choice changes and revocation each write one `key` event in the
    row's transaction, recording the row's new version. A role is never changed in place
    (the writer role cannot: ``test_audit_roles``): another role is another key."""
    key, plaintext = gateway.keys.create("app", "crm", "tests")
    gateway.keys.set_store_content("crm", True, "tests")
    gateway.keys.set_store_content("crm", None, "tests")
    gateway.keys.revoke("crm", "tests")
    changes = [(e["payload"]["action"], e["payload"]["version"]) for e in _events(gateway, "key")]
    assert changes == [
        ("created", 1),
        ("updated", 2),
        ("updated", 3),
        ("revoked", 4),
    ]
    assert _row(gateway.attacker, key.key_id)["version"] == 4
    assert gateway.keys.authenticate(plaintext) is None
    assert gateway.audit.tamper is None


def _events(gateway: Gateway, kind: str) -> list[dict[str, Any]]:
    with gateway.attacker.connect() as connection:
        rows = connection.execute(
            sa.select(audit_events).where(audit_events.c.kind == kind).order_by(audit_events.c.seq)
        )
        return [dict(row._mapping) for row in rows]


def test_a_row_mac_is_made_with_a_sub_key_not_the_event_key(gateway: Gateway) -> None:
    key, _ = gateway.keys.create("app", "crm", "tests")
    row = _row(gateway.attacker, key.key_id)
    assert row["row_mac"] == MAC.derived(ROW_MAC_LABEL).mac(row_bytes(row))
    assert row["row_mac"] != MAC.mac(row_bytes(row))
