"""The scheduled re-verification of the signed history: an old row edited in place, which no
checkpoint looks at again, is found within ``audit_reverify_period_s`` without anyone asking;
a sweep of an untouched log completes and says when."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from gateway.audit.log import AuditLog
from gateway.audit.signing import CheckpointSigner
from gateway.audit.sweep import slice_size, tick_seconds
from gateway.db import make_db_engine
from tests.api_harness import fresh_database, gateway_settings, live_gateway
from tests.audit.test_audit_tamper import MAC, consistent_rewrite, edit_payload, swap_rows
from tests.tiny_models import build_pair

SERVED = 40
SLICE = 7


@pytest.fixture
def db(pg_url: str) -> Iterator[sa.Engine]:
    engine = make_db_engine(pg_url)
    yield engine
    engine.dispose()


@pytest.fixture
def signed(db: sa.Engine, tmp_path: Path) -> AuditLog:
    signer = CheckpointSigner.load_or_create(tmp_path / "signing.pem")
    log = AuditLog(db, signer, MAC, tmp_path / "state.json")
    for i in range(SERVED):
        log.append("request", "key_app", {"i": i, "user": f"user-{i}"})
    log.checkpoint()
    return log


def sweep(log: AuditLog) -> int:
    """Slices until a sweep completes or the alarm is raised; how many."""
    for slices in range(1, 100):
        if log.reverify(SLICE) or log.tamper is not None:
            return slices
    raise AssertionError("the sweep neither completed nor alarmed")


def test_a_sweep_of_an_untouched_log_completes_in_slices(signed: AuditLog) -> None:
    assert sweep(signed) == math.ceil(SERVED / SLICE)
    assert signed.tamper is None and signed.reverified_at is not None
    assert sweep(signed) == math.ceil(SERVED / SLICE)  # and starts again


@pytest.mark.parametrize("attack", [edit_payload, consistent_rewrite, swap_rows])
def test_an_old_row_changed_in_place_is_found_by_the_sweep(signed: AuditLog, attack) -> None:  # type: ignore[no-untyped-def]
    attack(signed._db)
    assert signed.integrity_ok()  # no checkpoint or request looks at event 3 or 4 again
    sweep(signed)
    assert signed.tamper is not None
    assert signed.tamper.first_bad_seq in (3, 4)
    assert not signed.integrity_ok()


@given(
    size=st.integers(min_value=0, max_value=10**9),
    period=st.floats(min_value=1.0, max_value=10 * 86400.0),
)
def test_slices_cover_the_signed_history_within_the_period(size: int, period: float) -> None:
    tick = tick_seconds(period)
    assert 1.0 <= tick <= 60.0
    ticks = math.ceil(size / slice_size(size, tick, period)) if size else 0
    assert ticks * tick <= 0.9 * period + tick


def test_a_served_gateway_finds_an_edited_old_row_within_its_period(tmp_path: Path) -> None:
    """``audit_reverify_period_s`` 5 s: an edit of an old row, with no request, checkpoint or
    verification asked for, fails `/readyz` within the period and a tick."""
    models = build_pair(tmp_path / "models")
    period = 5.0
    with fresh_database() as (name, url):
        settings = gateway_settings(
            models, tmp_path / "data", url, audit_reverify_period_s=period, checkpoint_interval_s=1
        )
        with live_gateway(settings, name) as live:
            headers = {"authorization": f"Bearer {live.keys['app']}"}
            body = {"model": "target", "prompt": "hi", "max_tokens": 2}
            for _ in range(3):
                answer = httpx.post(live.base_url + "/v1/completions", json=body, headers=headers)
                assert answer.status_code == 200
            deadline = time.monotonic() + 3 * period
            while live.services.audit.reverified_at is None:
                assert time.monotonic() < deadline, "no sweep completed"
                time.sleep(0.2)
            metrics = httpx.get(live.base_url + "/metrics").text
            assert "specgate_audit_reverified_timestamp_seconds 1" in metrics

            attacker = make_db_engine(url)
            edit_payload(attacker)
            attacker.dispose()
            edited = time.monotonic()
            while httpx.get(live.base_url + "/readyz", timeout=30).status_code == 200:
                assert time.monotonic() - edited < period + tick_seconds(period) + 2
                time.sleep(0.2)
            assert live.services.audit.tamper is not None
            assert live.services.audit.tamper.first_bad_seq == 4
