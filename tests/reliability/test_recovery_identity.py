"""A replica restarted without its data directory (a rescheduled pod, an emptyDir) keeps its
identity when one is configured, so the requests its previous run left unanswered are marked
`interrupted`; without one it is a new instance and leaves them alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.audit.log import AuditLog
from gateway.audit.schema import audit_events
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine
from gateway.recovery import instance_id, mark_interrupted
from gateway.settings import ConfigError, load_settings


def _interrupted(db: sa.Engine, log: AuditLog, instance: str) -> list[str]:
    mark_interrupted(log, db, instance)
    query = sa.select(audit_events.c.payload).where(audit_events.c.kind == "interrupted")
    with db.connect() as connection:
        return [payload["request_event_id"] for payload in connection.scalars(query)]


@pytest.mark.parametrize("configured", ["gateway-0", None])
def test_a_restart_on_an_empty_data_directory_marks_the_previous_runs_requests_if_configured(
    pg_url: str, tmp_path: Path, configured: str | None
) -> None:
    db = make_db_engine(pg_url)
    log = AuditLog(db, CheckpointSigner.load_or_create(tmp_path / "s.pem"))
    first = instance_id(tmp_path / "first-run", configured)
    log.append("startup", "specgate", {"instance_id": first})
    cut = log.append("request", "key_a", {"instance_id": first, "request_id": "r1"})
    answered = log.append("request", "key_a", {"instance_id": first, "request_id": "r2"})
    log.append("completion", "key_a", {"request_event_id": answered.event_id})

    again = instance_id(tmp_path / "second-run", configured)  # a fresh, empty data directory
    marked = _interrupted(db, log, again)
    assert marked == ([cut.event_id] if configured else [])
    assert (again == first) is (configured is not None)
    db.dispose()


def test_the_instance_id_comes_from_the_environment_and_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPECGATE_INSTANCE_ID", "specgate-1")
    assert load_settings().instance_id == "specgate-1"
    monkeypatch.setenv("SPECGATE_INSTANCE_ID", "../x")
    with pytest.raises(ConfigError, match="instance_id"):
        load_settings()
