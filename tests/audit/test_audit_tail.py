"""The newest events, which no checkpoint covers yet, and alarms that outlive a restart.

The attacker is the PostgreSQL superuser without the gateway's keys. Between two checkpoints
the gateway keeps the tree after its newest committed append (the anchor) in memory and in a
file beside its signing key, written before the append's caller is answered; it never appends
on a head that does not extend it. A raised alarm is kept in a file beside it too, so a
restarted gateway stays not ready and signs nothing until an operator clears the alarm with an
``alarm_cleared`` event that names the evidence.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.audit.log import AuditLog, TamperDetectedError
from gateway.audit.merkle import verify_consistency
from gateway.audit.records import unb64_hash
from gateway.audit.schema import audit_events, audit_head
from gateway.audit.signing import CheckpointSigner
from gateway.audit.state import load_anchor
from gateway.db import make_db_engine
from tests.audit.test_audit_tamper import (
    MAC,
    consistent_rewrite,
    edit_payload,
    forged_insert_at_head,
    rewrite,
)

SERVED = 12  # requests before the attack; a checkpoint covers them


@pytest.fixture
def db(pg_url: str) -> Iterator[sa.Engine]:
    engine = make_db_engine(pg_url)
    yield engine
    engine.dispose()


def gateway(db: sa.Engine, tmp_path: Path) -> AuditLog:
    """A gateway's audit log over ``db`` with its files in ``tmp_path`` (a restart is a new
    one over the same files)."""
    signer = CheckpointSigner.load_or_create(tmp_path / "signing.pem")
    return AuditLog(db, signer, MAC, tmp_path / "audit-checkpoint-state.json")


@pytest.fixture
def served(db: sa.Engine, tmp_path: Path) -> AuditLog:
    log = gateway(db, tmp_path)
    for i in range(SERVED):
        log.append("request", "key_app", {"i": i})
    log.checkpoint()
    return log


def serve_unsigned(log: AuditLog, count: int) -> None:
    for i in range(count):
        log.append("request", "key_app", {"late": i})


def kinds(db: sa.Engine) -> list[str]:
    with db.connect() as connection:
        return list(connection.scalars(sa.select(audit_events.c.kind).order_by("seq")))


def head_size(db: sa.Engine) -> int:
    with db.connect() as connection:
        return int(connection.scalar(sa.select(audit_head.c.tree_size)) or 0)


def test_the_anchor_is_on_disk_when_an_append_returns(served: AuditLog, tmp_path: Path) -> None:
    appended = served.append("request", "key_app", {"one": "more"})
    anchor = load_anchor(tmp_path / "audit-checkpoint-state.appended")
    assert anchor.size == appended.seq == head_size(served._db)


def test_truncating_the_unsigned_tail_under_traffic_is_refused(
    served: AuditLog, db: sa.Engine
) -> None:
    """Delete the newest 7 events, reset the head and the tree to the earlier size, and let
    traffic continue: the next append is refused and the alarm raised."""
    serve_unsigned(served, 7)
    truncated_at = head_size(db) - 7
    rewrite(db, lambda events: events[:-7])
    with pytest.raises(TamperDetectedError, match="truncation") as raised:
        served.append("request", "key_app", {"after": "attack"})
    assert raised.value.first_bad_seq == truncated_at + 1
    # Nothing appended on the shorter history but the alarm itself.
    assert kinds(db)[truncated_at:] == ["tamper_detected"]
    assert not served.integrity_ok()
    with pytest.raises(TamperDetectedError):
        served.checkpoint()
    with pytest.raises(TamperDetectedError):  # every later request is refused too
        served.append("request", "key_app", {"after": "attack", "n": 2})


def test_a_rewritten_tail_of_the_same_length_is_refused(served: AuditLog, db: sa.Engine) -> None:
    """The newest events replaced by as many others (chain and tree recomputed, old MACs):
    same size, another root."""
    serve_unsigned(served, 3)

    def replace_last(events: list[dict[str, object]]) -> list[dict[str, object]]:
        events[-1]["payload"] = {"late": "forged"}
        return events

    rewrite(db, replace_last)
    with pytest.raises(TamperDetectedError, match="not those this gateway wrote"):
        served.append("request", "key_app", {"after": "attack"})


def test_other_writers_appends_extend_the_anchor(served: AuditLog, db: sa.Engine) -> None:
    """Another writer (a replica, the key CLI) moving the head is no alarm: the anchor's root
    is found again in the stored tree."""
    serve_unsigned(served, 3)
    replica = AuditLog(db, mac=MAC)
    for i in range(5):
        replica.append("request", "key_replica", {"i": i})
    served.forget_known_head()  # as after any other writer's append
    served.append("request", "key_app", {"after": "replica"})
    assert served.integrity_ok()
    served.checkpoint()


def test_truncation_while_stopped_is_caught_after_a_restart(
    served: AuditLog, db: sa.Engine, tmp_path: Path
) -> None:
    serve_unsigned(served, 7)
    rewrite(db, lambda events: events[:-7])
    restarted = gateway(db, tmp_path)
    with pytest.raises(TamperDetectedError, match="truncation"):
        restarted.checkpoint()
    assert not restarted.integrity_ok()


@pytest.mark.parametrize("attack", ["edit", "truncation"])
def test_an_alarm_outlives_a_restart(
    served: AuditLog, db: sa.Engine, tmp_path: Path, attack: str
) -> None:
    """(a) an edited old row, found by a verification; (b) the idle truncation, found by a
    checkpoint. A restarted gateway is not ready and signs nothing."""
    if attack == "edit":
        consistent_rewrite(db)
        assert not served.verify().ok
    else:
        serve_unsigned(served, 7)
        rewrite(db, lambda events: events[:-7])
        with pytest.raises(TamperDetectedError):
            served.checkpoint()
    restarted = gateway(db, tmp_path)
    assert not restarted.integrity_ok()
    assert restarted.alarm is not None and restarted.alarm.reason == served.alarm.reason  # type: ignore[union-attr]
    with pytest.raises(TamperDetectedError):
        restarted.checkpoint()


def test_clearing_an_alarm_is_an_audit_event_naming_the_evidence(
    served: AuditLog, db: sa.Engine, tmp_path: Path
) -> None:
    edit_payload(db)  # the event's MAC fails; its leaf and the tree are as written
    assert not served.verify().ok
    restarted = gateway(db, tmp_path)
    with pytest.raises(ValueError, match="evidence"):
        restarted.clear_alarm("  ", "admin:ops")
    payload = restarted.clear_alarm("INC-4711: rows restored from backup", "admin:ops")
    assert payload["evidence"] == "INC-4711: rows restored from backup"
    assert payload["alarm"]["first_bad_seq"] == 4
    assert kinds(db)[-1] == "alarm_cleared"
    assert restarted.integrity_ok()
    assert gateway(db, tmp_path).integrity_ok()  # cleared on disk too
    # The history is still edited: the next verification raises the alarm again.
    assert not restarted.verify().ok


def test_a_truncation_is_cleared_only_by_restoring_or_accepting_the_loss(
    served: AuditLog, db: sa.Engine
) -> None:
    serve_unsigned(served, 7)
    signed = served.signed_state
    written = head_size(db)
    rewrite(db, lambda events: events[:-7])
    with pytest.raises(TamperDetectedError):
        served.append("request", "key_app", {"after": "attack"})
    with pytest.raises(TamperDetectedError):  # not recorded over the shorter history
        served.clear_alarm("looked at it", "admin:ops")
    payload = served.clear_alarm("INC-4712: replica lost 7 events", "admin:ops", True)
    accepted = payload["accepted_head"]
    assert (accepted["size"], accepted["written"]["size"]) == (written - 7 + 1, written)
    served.append("request", "key_app", {"after": "accepted"})
    checkpoint = served.checkpoint()  # still extends the last signed checkpoint
    proof = served.consistency_proof(signed.frontier.size, checkpoint["size"])
    verify_consistency(
        signed.frontier.size,
        checkpoint["size"],
        proof,
        signed.frontier.root(),
        unb64_hash(checkpoint["root"]),
    )


def test_an_idle_truncation_is_seen_by_the_watch(served: AuditLog, db: sa.Engine) -> None:
    serve_unsigned(served, 7)
    rewrite(db, lambda events: events[:-7])
    served.watch()  # no request, no checkpoint
    assert served.tamper is not None and "truncation" in served.tamper.reason


def test_a_forged_event_at_the_head_is_seen_by_the_watch(served: AuditLog, db: sa.Engine) -> None:
    forged_insert_at_head(db)
    forged = head_size(db)
    served.watch()
    assert served.tamper is not None and served.tamper.first_bad_seq == forged


def test_an_old_row_rewritten_with_its_tree_is_seen_by_the_watch(
    served: AuditLog, db: sa.Engine
) -> None:
    consistent_rewrite(db)
    served.watch()
    assert served.tamper is not None and served.tamper.first_bad_seq == 4


def test_the_watch_verifies_other_writers_events_and_moves_on(
    served: AuditLog, db: sa.Engine, tmp_path: Path
) -> None:
    replica = AuditLog(db, mac=MAC)
    for i in range(5):
        replica.append("request", "key_replica", {"i": i})
    served.watch()
    assert served.tamper is None
    assert load_anchor(tmp_path / "audit-checkpoint-state.appended").size == head_size(db)
    AuditLog(db).append("request", "key_forger", {"no": "mac"})  # a writer without the key
    forged = head_size(db)
    served.watch()
    assert served.tamper is not None and served.tamper.first_bad_seq == forged
