"""The audit log's transparency endpoints end to end on a live gateway: receipts on every
completion, inclusion proofs checked offline with `specgate audit verify-receipt`, the latest
checkpoint and consistency proofs, the witness CLI and the cosignature age bound of /readyz,
and the tamper alarm (last: it leaves the gateway not ready)."""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from gateway.audit.merkle import verify_consistency
from gateway.audit.note import cosignature_time, verify_checkpoint
from gateway.audit.receipt import verify_receipt
from gateway.audit.signing import load_or_create_private_key, public_key_pem
from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.audit_helpers import admin_cli
from tests.tiny_models import build_pair

CHAT = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
WITNESS = "compliance-witness"
LOCK_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def witness_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The witness's state directory, its key made before the gateway starts (to pin it)."""
    folder = tmp_path_factory.mktemp("witness")
    key = load_or_create_private_key(folder / "witness-key.pem")
    (folder / "witness-public-key.pem").write_bytes(public_key_pem(key.public_key()))
    return folder


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, witness_dir: Path) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("audit-api")
    models = build_pair(root / "models")
    with fresh_database() as (name, url):
        settings = gateway_settings(
            models,
            root / "data",
            url,
            witness_public_key_path=witness_dir / "witness-public-key.pem",
            witness_name=WITNESS,
            witness_max_age_s=600.0,
            audit_lock_timeout_s=LOCK_TIMEOUT_S,
        )
        with live_gateway(settings, name) as live:
            yield live


def get(gateway: LiveGateway, path: str, role: str, **params: object) -> httpx.Response:
    headers = {"authorization": f"Bearer {gateway.keys[role]}"}
    return httpx.get(gateway.base_url + path, headers=headers, params=params, timeout=60)


def chat(gateway: LiveGateway, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key or gateway.keys['app']}"}
    response = httpx.post(
        gateway.base_url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60
    )
    assert response.status_code == 200
    return response


def test_every_completion_carries_a_receipt_that_verifies_offline(
    gateway: LiveGateway, tmp_path: Path
) -> None:
    response = chat(gateway)
    audit_id = response.headers["x-specgate-audit-id"]
    index = int(response.headers["x-specgate-audit-leaf-index"])
    leaf = response.headers["x-specgate-audit-leaf-hash"]
    assert len(base64.b64decode(leaf)) == 32
    receipt = get(gateway, f"/v1/audit/proof/{audit_id}", "app")
    assert receipt.status_code == 200
    body = receipt.json()
    assert (body["leaf_index"], body["leaf_hash"]) == (index, leaf)
    assert body["event"]["event_id"] == audit_id and body["event"]["kind"] == "request"
    pem = gateway.services.signer.public_key_pem()
    assert verify_receipt(body, pem, leaf).startswith(f"event {index + 1} ")
    (tmp_path / "receipt.json").write_text(json.dumps(body))
    (tmp_path / "pub.pem").write_bytes(pem)
    args = ["audit", "verify-receipt", str(tmp_path / "receipt.json")]
    args += ["--public-key", str(tmp_path / "pub.pem"), "--leaf-hash", leaf]
    result = CliRunner().invoke(admin_cli(), args)
    assert result.exit_code == 0, result.output
    # A receipt whose proof was tampered with is refused.
    body["inclusion_proof"][0] = base64.b64encode(b"\0" * 32).decode()
    (tmp_path / "receipt.json").write_text(json.dumps(body))
    result = CliRunner().invoke(admin_cli(), args)
    assert result.exit_code == 1 and "not in the signed tree" in result.output


def test_proofs_are_for_the_auditor_and_the_requesting_app_only(gateway: LiveGateway) -> None:
    audit_id = chat(gateway).headers["x-specgate-audit-id"]
    assert get(gateway, f"/v1/audit/proof/{audit_id}", "auditor").status_code == 200
    assert get(gateway, f"/v1/audit/proof/{audit_id}", "admin").status_code == 403
    _, other = gateway.services.keys.create("app", "another-app", "tests")
    headers = {"authorization": f"Bearer {other}"}
    response = httpx.get(f"{gateway.base_url}/v1/audit/proof/{audit_id}", headers=headers)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_checkpoint_and_consistency_endpoints(gateway: LiveGateway) -> None:
    key = gateway.services.signer.public_key
    first = verify_checkpoint(get(gateway, "/v1/audit/checkpoint", "auditor").text, key)
    chat(gateway)
    gateway.services.audit.checkpoint()
    second = verify_checkpoint(get(gateway, "/v1/audit/checkpoint", "auditor").text, key)
    assert second.size > first.size
    answer = get(
        gateway, "/v1/audit/consistency", "auditor", **{"from": first.size, "to": second.size}
    )
    assert answer.status_code == 200
    proof = [base64.b64decode(h) for h in answer.json()["proof"]]
    verify_consistency(first.size, second.size, proof, first.root, second.root)
    bad = get(gateway, "/v1/audit/consistency", "auditor", **{"from": 5, "to": 4})
    assert bad.status_code == 400
    assert get(gateway, "/v1/audit/checkpoint", "app").status_code == 403


def test_witness_cosigns_and_readyz_requires_a_fresh_cosignature(
    gateway: LiveGateway, witness_dir: Path
) -> None:
    ready = httpx.get(gateway.base_url + "/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["audit_integrity"] is False
    args = ["audit", "witness", "--url", gateway.base_url, "--key", gateway.keys["auditor"]]
    args += ["--state", str(witness_dir), "--name", WITNESS]
    result = CliRunner().invoke(admin_cli(), args)
    assert result.exit_code == 0, result.output
    assert re.search(r"cosigned \S+ at size \d+ \(first checkpoint\)", result.output)
    assert '"accepted":true' in result.output
    assert httpx.get(gateway.base_url + "/readyz").status_code == 200
    chat(gateway)
    gateway.services.audit.checkpoint()
    result = CliRunner().invoke(admin_cli(), args)
    assert result.exit_code == 0 and "(from " in result.output, result.output
    stored = (witness_dir / "checkpoint").read_text()
    witness_key = load_or_create_private_key(witness_dir / "witness-key.pem").public_key()
    assert cosignature_time(stored, WITNESS, witness_key) > 0


def test_a_held_append_lock_is_a_503_within_the_lock_timeout(gateway: LiveGateway) -> None:
    url = gateway.services.settings.database_url
    with psycopg.connect(url) as holder:
        holder.execute("SELECT * FROM audit_head FOR UPDATE")
        started = time.monotonic()
        response = httpx.post(
            gateway.base_url + "/v1/chat/completions",
            json=CHAT,
            headers={"authorization": f"Bearer {gateway.keys['app']}"},
            timeout=30,
        )
        waited = time.monotonic() - started
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "audit_unavailable"
    assert waited < LOCK_TIMEOUT_S + 2.0
    chat(gateway)  # the lock is gone: served again


def test_tamper_alarm_fails_readyz_and_counts(gateway: LiveGateway, witness_dir: Path) -> None:
    gateway.services.audit.checkpoint()
    with gateway.services.db.begin() as connection:
        connection.exec_driver_sql("ALTER TABLE audit_head DISABLE TRIGGER ALL")
        connection.execute(sa.text("UPDATE audit_head SET tree_size = tree_size - 1"))
        connection.exec_driver_sql("ALTER TABLE audit_head ENABLE TRIGGER ALL")
    verified = get(gateway, "/v1/audit/verify", "auditor").json()
    assert verified["ok"] is False
    ready = httpx.get(gateway.base_url + "/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["audit_integrity"] is False
    metrics = httpx.get(gateway.base_url + "/metrics").text
    assert "specgate_audit_tamper_detected_total 1.0" in metrics
    assert get(gateway, "/v1/audit/export", "auditor").status_code == 503
