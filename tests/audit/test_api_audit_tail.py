"""A served gateway, on its writer role, whose newest unsigned events the PostgreSQL superuser
deletes while traffic goes on: the next request is refused (503), `/readyz` fails, a restart
does not forget it (the gateway refuses to start on the shorter history), and the alarm ends
only with an `alarm_cleared` event that names the evidence."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import sqlalchemy as sa
from typer.testing import CliRunner

from gateway.audit.schema import audit_events
from gateway.db import make_db_engine, upgrade_database
from tests.api_harness import fresh_database, gateway_settings, live_gateway, writer_login
from tests.audit.test_audit_tamper import rewrite
from tests.audit_helpers import admin_cli
from tests.tiny_models import build_pair

CHAT = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
DETECTION_BOUND_S = 15.0  # docs/compliance.md


def chat(base_url: str, key: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(base_url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60)


def kinds(db: sa.Engine) -> list[str]:
    with db.connect() as connection:
        return list(connection.scalars(sa.select(audit_events.c.kind).order_by("seq")))


def test_a_truncated_tail_under_traffic_is_refused_and_stays_refused(tmp_path: Path) -> None:
    models = build_pair(tmp_path / "models")
    with fresh_database() as (name, superuser_url), writer_login(name) as writer_url:
        upgrade_database(superuser_url)
        attacker = make_db_engine(superuser_url)
        settings = gateway_settings(
            models, tmp_path / "data", writer_url, migrate=False, checkpoint_interval_s=3600
        )
        with live_gateway(settings, name) as live:
            for _ in range(3):
                assert chat(live.base_url, live.keys["app"]).status_code == 200
            written = len(kinds(attacker))
            rewrite(attacker, lambda events: events[:-7])  # 3 requests' events and more

            refused = chat(live.base_url, live.keys["app"])
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "audit_unavailable"
            started = time.monotonic()
            while httpx.get(live.base_url + "/readyz", timeout=30).status_code == 200:
                assert time.monotonic() - started < DETECTION_BOUND_S
                time.sleep(0.2)
            assert chat(live.base_url, live.keys["app"]).status_code == 503
            assert kinds(attacker)[written - 7 :] == ["tamper_detected"]

        # A restart keeps the alarm: the gateway will not write its startup event on a
        # history shorter than the one it wrote, so it does not start.
        try:
            with live_gateway(settings, name):
                raise AssertionError("the gateway started over a truncated history")
        except RuntimeError:
            pass

        # Cleared on the stopped gateway's own files: refused while the events are missing,
        # recorded with the evidence and the replaced tree once the loss is accepted.
        env = {
            "SPECGATE_DATABASE_URL": writer_url,
            "SPECGATE_DATA_DIR": str(tmp_path / "data"),
        }
        cli = CliRunner()
        kept = cli.invoke(admin_cli(), ["audit", "clear-alarm", "--evidence", "INC-1"], env=env)
        assert kept.exit_code == 1, kept.output
        assert "truncation" in kept.output
        evidence = "INC-1: failover lost 7 events; see the forensic report"
        cleared = cli.invoke(
            admin_cli(),
            ["audit", "clear-alarm", "--evidence", evidence, "--accept-head"],
            env=env,
        )
        assert cleared.exit_code == 0, cleared.output
        assert kinds(attacker)[-1] == "alarm_cleared"

        with live_gateway(settings, name, key_prefix="restarted") as live:
            assert chat(live.base_url, live.keys["app"]).status_code == 200
            assert httpx.get(live.base_url + "/readyz", timeout=30).status_code == 200
        attacker.dispose()


def test_clearing_needs_an_admin_and_an_alarm(tmp_path: Path) -> None:
    models = build_pair(tmp_path / "models")
    with (
        fresh_database() as (name, url),
        live_gateway(gateway_settings(models, tmp_path / "data", url), name) as live,
    ):
        path = live.base_url + "/v1/admin/audit/alarm/clear"
        body = {"evidence": "nothing happened"}
        for role, status in (("app", 403), ("auditor", 403), ("admin", 409)):
            headers = {"authorization": f"Bearer {live.keys[role]}"}
            answer = httpx.post(path, json=body, headers=headers, timeout=30)
            assert answer.status_code == status, (role, answer.text)
        assert answer.json()["error"]["code"] == "no_alarm"
        command = ["audit", "clear-alarm", "--evidence", "x", "--url", live.base_url]
        kept = CliRunner().invoke(admin_cli(), [*command, "--key", live.keys["admin"]])
        assert kept.exit_code == 1 and "no tamper alarm stands" in kept.output
        refused = CliRunner().invoke(admin_cli(), [*command, "--key", live.keys["app"]])
        assert refused.exit_code == 2 and "error (403)" in refused.output


def test_an_idle_gateway_sees_a_truncation_within_its_watch_interval(tmp_path: Path) -> None:
    """No request and no checkpoint after the deletion: the watch (``audit_watch_interval_s``)
    raises the alarm and `/readyz` fails within the interval and a read."""
    models = build_pair(tmp_path / "models")
    interval = 2.0
    with fresh_database() as (name, superuser_url), writer_login(name) as writer_url:
        upgrade_database(superuser_url)
        attacker = make_db_engine(superuser_url)
        settings = gateway_settings(
            models,
            tmp_path / "data",
            writer_url,
            migrate=False,
            checkpoint_interval_s=3600,
            audit_watch_interval_s=interval,
        )
        with live_gateway(settings, name) as live:
            assert chat(live.base_url, live.keys["app"]).status_code == 200
            rewrite(attacker, lambda events: events[:-2])
            deleted = time.monotonic()
            while httpx.get(live.base_url + "/readyz", timeout=30).status_code == 200:
                assert time.monotonic() - deleted < interval + 3.0
                time.sleep(0.1)
            assert "truncation" in str(live.services.audit.tamper)
        attacker.dispose()
