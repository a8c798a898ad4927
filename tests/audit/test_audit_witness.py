"""The witness against gateways that stop signing: a live gateway that raised its tamper
alarm (a row rewritten and found by its own check, or a forged head row found by its
checkpoint loop) is reported as ``gateway_alarm`` and never re-cosigned; a gateway that
serves but leaves events without a covering checkpoint for longer than the bound is
reported as ``stale_checkpoint``; an idle, healthy gateway keeps passing. Also the
auditor-only ``GET /v1/audit/status`` the witness reads."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from gateway.audit.log import AuditLog
from gateway.audit.mac import EventMac
from gateway.audit.signing import CheckpointSigner, load_or_create_private_key, public_key_pem
from gateway.audit.witness import WitnessAlarm, witness_once
from gateway.db import make_db_engine
from gateway.keys import KeyStore
from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.audit_helpers import admin_cli, audit_only_app, serve
from tests.tiny_models import build_pair

WITNESS = "compliance-witness"
CHECKPOINT_INTERVAL_S = 0.5
AGE_BOUND_S = 2.0  # four checkpoint intervals
ALARM_WAIT_S = 20.0


def make_witness_dir(folder: Path) -> Path:
    """A witness state directory whose key exists before the gateway starts (to pin it)."""
    key = load_or_create_private_key(folder / "witness-key.pem")
    (folder / "witness-public-key.pem").write_bytes(public_key_pem(key.public_key()))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("witness-models"))


@contextmanager
def signing_gateway(
    models: tuple[Path, Path], root: Path, witness_dir: Path
) -> Iterator[LiveGateway]:
    """A live gateway on a fresh database, signing a checkpoint every half second."""
    with fresh_database() as (name, url):
        settings = gateway_settings(
            models,
            root / "data",
            url,
            checkpoint_interval_s=CHECKPOINT_INTERVAL_S,
            witness_public_key_path=witness_dir / "witness-public-key.pem",
            witness_name=WITNESS,
        )
        with live_gateway(settings, name) as live:
            yield live


@pytest.fixture(scope="module")
def healthy(
    models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveGateway, Path]]:
    witness_dir = make_witness_dir(tmp_path_factory.mktemp("healthy-witness"))
    root = tmp_path_factory.mktemp("healthy")
    with signing_gateway(models, root, witness_dir) as live:
        yield live, witness_dir


def cli_witness(gateway: LiveGateway, witness_dir: Path, *extra: str) -> tuple[int, str]:
    args = ["audit", "witness", "--url", gateway.base_url, "--key", gateway.keys["auditor"]]
    args += ["--state", str(witness_dir), "--name", WITNESS, *extra]
    result = CliRunner().invoke(admin_cli(), args)
    return result.exit_code, result.output


def test_status_tells_the_auditor_the_logs_integrity(healthy: tuple[LiveGateway, Path]) -> None:
    gateway, _ = healthy
    gateway.services.audit.checkpoint()
    headers = {"authorization": f"Bearer {gateway.keys['auditor']}"}
    status = httpx.get(f"{gateway.base_url}/v1/audit/status", headers=headers).json()
    assert status["tamper"] is None
    assert 0 < status["newest_checkpoint_size"] <= status["tree_size"]
    assert status["newest_checkpoint_signed_at"] <= status["now"]
    headers = {"authorization": f"Bearer {gateway.keys['app']}"}
    assert httpx.get(f"{gateway.base_url}/v1/audit/status", headers=headers).status_code == 403


def test_an_idle_healthy_gateway_keeps_passing_the_witness(
    healthy: tuple[LiveGateway, Path],
) -> None:
    gateway, witness_dir = healthy
    bound = ["--max-checkpoint-age", str(AGE_BOUND_S)]
    code, output = cli_witness(gateway, witness_dir, *bound)
    assert code == 0, output
    first = (witness_dir / "checkpoint").read_text()
    time.sleep(AGE_BOUND_S * 2)  # no requests: only the gateway's own checkpoints
    code, output = cli_witness(gateway, witness_dir, *bound)
    assert code == 0, output
    assert "(from " in output and (witness_dir / "checkpoint").read_text() != first


def rewrite_a_row(gateway: LiveGateway) -> None:
    """As superuser: change an event's payload, then let the gateway's own check find it."""
    with gateway.services.db.begin() as connection:
        connection.exec_driver_sql("ALTER TABLE audit_events DISABLE TRIGGER ALL")
        connection.execute(
            sa.text("UPDATE audit_events SET payload = '{\"forged\": true}' WHERE seq = 2")
        )
        connection.exec_driver_sql("ALTER TABLE audit_events ENABLE TRIGGER ALL")
    headers = {"authorization": f"Bearer {gateway.keys['auditor']}"}
    httpx.get(f"{gateway.base_url}/v1/audit/verify", headers=headers, timeout=60)


def forge_the_head(gateway: LiveGateway) -> None:
    """As superuser: move the head row back one event; the checkpoint loop finds it."""
    with gateway.services.db.begin() as connection:
        connection.exec_driver_sql("ALTER TABLE audit_head DISABLE TRIGGER ALL")
        connection.execute(sa.text("UPDATE audit_head SET tree_size = tree_size - 1"))
        connection.exec_driver_sql("ALTER TABLE audit_head ENABLE TRIGGER ALL")


def wait_for_alarm(gateway: LiveGateway) -> None:
    deadline = time.monotonic() + ALARM_WAIT_S
    while gateway.services.audit.tamper is None:
        assert time.monotonic() < deadline, "the gateway raised no alarm"
        time.sleep(0.1)


@pytest.mark.parametrize("attack", [rewrite_a_row, forge_the_head], ids=lambda a: a.__name__)
def test_a_gateway_that_raised_its_alarm_is_reported_not_recosigned(
    models: tuple[Path, Path], tmp_path: Path, attack: Callable[[LiveGateway], None]
) -> None:
    witness_dir = make_witness_dir(tmp_path / "witness")
    with signing_gateway(models, tmp_path, witness_dir) as gateway:
        code, output = cli_witness(gateway, witness_dir)
        assert code == 0, output
        attack(gateway)
        wait_for_alarm(gateway)
        cosigned = (witness_dir / "checkpoint").read_text()
        code, output = cli_witness(gateway, witness_dir)
        assert code == 1, output
        assert "ALARM (gateway_alarm)" in output
        alarm = gateway.services.audit.tamper
        assert alarm is not None and alarm.reason in output
        assert (witness_dir / "checkpoint").read_text() == cosigned


@pytest.fixture
def unsigning(pg_url: str, tmp_path: Path) -> Iterator[tuple[AuditLog, str, str]]:
    """The audit routes of a gateway that serves but signs only when told (no checkpoint
    loop), and an auditor key."""
    db = make_db_engine(pg_url)
    signer = CheckpointSigner.load_or_create(tmp_path / "signing.pem")
    audit = AuditLog(db, signer, EventMac(b"s" * 32))
    keys = KeyStore(db, audit)
    _, auditor_key = keys.create("auditor", "compliance", "tests")
    with serve(audit_only_app(audit, keys, db)) as url:
        yield audit, url, auditor_key
    db.dispose()


def test_events_left_without_a_checkpoint_past_the_bound_are_a_stale_alarm(
    unsigning: tuple[AuditLog, str, str], tmp_path: Path
) -> None:
    audit, url, key = unsigning
    state, bound = tmp_path / "witness", 1.0
    audit.append("request", "key_0", {"i": 0})
    witness_once(url, key, state, "w", max_checkpoint_age_s=bound)  # signs the first one
    cosigned = (state / "checkpoint").read_text()
    audit.append("request", "key_0", {"i": 1})  # served, never covered by a checkpoint
    time.sleep(bound * 1.5)
    with pytest.raises(WitnessAlarm) as alarm:
        witness_once(url, key, state, "w", max_checkpoint_age_s=bound)
    assert alarm.value.kind == "stale_checkpoint"
    assert (state / "checkpoint").read_text() == cosigned
    audit.checkpoint()  # signing resumes: nothing waits any more
    assert witness_once(url, key, state, "w", max_checkpoint_age_s=bound).checkpoint.size > 0
