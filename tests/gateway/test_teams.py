"""Teams and quotas in the store, against whoever controls the database: a key moved to
another team by editing its row, or a quota event rewritten, is refused and raises the tamper
alarm; and ``specgate teams`` / ``specgate keys quota|team`` record each change as an event."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from gateway.audit.log import AuditLog
from gateway.audit.mac import EventMac
from gateway.audit.schema import api_keys, audit_events
from gateway.cli import app as specgate
from gateway.db import make_db_engine
from gateway.keys import KeyStore, KeyStoreError
from gateway.quota_limits import Limits
from gateway.quotas import QuotaStore, QuotaUnverifiableError, key_subject, team_subject
from tests.audit.test_audit_tamper import rewrite

MAC = EventMac(b"t" * 32)


@pytest.fixture
def audit(db: sa.Engine) -> AuditLog:
    return AuditLog(db, mac=MAC)


def test_a_key_moved_to_a_team_outside_the_gateway_is_refused(
    db: sa.Engine, audit: AuditLog
) -> None:
    keys, quotas = KeyStore(db, audit), QuotaStore(db, audit)
    quotas.create_team("small", Limits(rpm_limit=1), "admin")
    quotas.create_team("big", Limits(), "admin")
    member, member_key = keys.create("app", "member", "admin")
    other, other_key = keys.create("app", "other", "admin")
    keys.set_team("member", "small", "admin")
    found = keys.authenticate(member_key)
    assert found is not None and found.team == "small"
    with pytest.raises(KeyStoreError, match="no team named"):
        keys.set_team("member", "nobody", "admin")

    alarms: list[str] = []
    audit.on_tamper = lambda error: alarms.append(str(error))  # type: ignore[method-assign]
    with db.begin() as connection:
        connection.execute(
            sa.update(api_keys).where(api_keys.c.key_id == member.key_id).values(team_id="big")
        )
        connection.execute(
            sa.update(api_keys).where(api_keys.c.key_id == other.key_id).values(team_id="big")
        )
    assert keys.authenticate(member_key) is None
    assert keys.authenticate(other_key) is None
    assert alarms and "does not carry the gateway's MAC" in alarms[0]  # one alarm stands


def test_a_rewritten_quota_event_is_refused(pg_url: str) -> None:
    db = make_db_engine(pg_url)
    audit = AuditLog(db, mac=MAC)
    quotas = QuotaStore(db, audit)
    quotas.set(key_subject("key_a"), Limits(rpm_limit=5), "admin")
    quotas.set(key_subject("key_b"), Limits(rpm_limit=1), "admin")
    assert quotas.limits([key_subject("key_a")])[key_subject("key_a")].rpm_limit == 5

    def raise_limit(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for event in events:
            if event["kind"] == "quota":
                event["payload"] = {**event["payload"], "rpm_limit": 5000}
        return events

    rewrite(db, raise_limit)
    alarms: list[str] = []
    audit.on_tamper = lambda error: alarms.append(str(error))  # type: ignore[method-assign]
    with pytest.raises(QuotaUnverifiableError, match="fails its MAC"):
        quotas.limits([key_subject("key_a")])
    assert alarms
    db.dispose()


def test_teams_and_quota_commands_record_events(db_url: str, db: sa.Engine, tmp_path: Path) -> None:
    runner = CliRunner()
    env = {"SPECGATE_DATABASE_URL": db_url, "SPECGATE_DATA_DIR": str(tmp_path)}
    mac = EventMac.load_or_create(tmp_path / "audit-mac-key")
    keys = KeyStore(db, AuditLog(db, mac=mac))
    key, plaintext = keys.create("app", "crm", "tests")

    def run(*args: str) -> str:
        result = runner.invoke(specgate, list(args), env=env)
        assert result.exit_code == 0, result.output
        return result.stdout

    run(
        "teams",
        "create",
        "sales",
        "--rpm-limit",
        "60",
        "--token-budget",
        "1000000",
        "--budget-period",
        "month",
    )
    assert "team:sales: rpm_limit=60, token_budget=1000000, budget_period=month" in run(
        "teams", "list"
    )
    run("teams", "quota", "sales", "--tpm-limit", "5000")
    run("keys", "quota", "crm", "--rpm-limit", "10")
    assert "team sales" in run("keys", "team", "crm", "--team", "sales")
    moved = keys.authenticate(plaintext)
    assert moved is not None and moved.team == "sales"
    unknown = runner.invoke(specgate, ["keys", "team", "crm", "--team", "nobody"], env=env)
    assert unknown.exit_code == 1 and "no team named" in unknown.output

    store = QuotaStore(db, AuditLog(db, mac=mac))
    limits = store.limits([team_subject("sales"), key_subject(key.key_id)])
    assert limits[team_subject("sales")] == Limits(tpm_limit=5000)
    assert limits[key_subject(key.key_id)] == Limits(rpm_limit=10)
    with db.connect() as connection:
        kinds = [
            (row.kind, row.actor.startswith("cli:"))
            for row in connection.execute(
                sa.select(audit_events.c.kind, audit_events.c.actor)
                .where(audit_events.c.kind.in_(["team", "quota"]))
                .order_by(audit_events.c.seq)
            )
        ]
    assert kinds == [("team", True), ("quota", True), ("quota", True), ("quota", True)]
