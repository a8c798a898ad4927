"""A row lock held on ``audit_head`` (the append lock) stalls every append: requests get 503
after the lock timeout, and `/readyz` fails within the same bound, then recovers when the lock
is let go."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psycopg

from tests.api_harness import fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_pair

LOCK_TIMEOUT_S = 1.0
AUDIT_TIMEOUT_S = 2.0
SLACK_S = 1.5


def readyz(base_url: str) -> tuple[int, float]:
    started = time.monotonic()
    status = httpx.get(base_url + "/readyz", timeout=30).status_code
    return status, time.monotonic() - started


def test_a_held_append_lock_fails_readiness_within_the_bound(tmp_path: Path) -> None:
    models = build_pair(tmp_path / "models")
    with fresh_database() as (name, url):
        settings = gateway_settings(
            models,
            tmp_path / "data",
            url,
            audit_lock_timeout_s=LOCK_TIMEOUT_S,
            audit_timeout_s=AUDIT_TIMEOUT_S,
        )
        with live_gateway(settings, name) as live:
            assert readyz(live.base_url)[0] == 200
            with psycopg.connect(url) as holder:
                holder.execute("SELECT * FROM audit_head FOR UPDATE")  # held, idle
                status, waited = readyz(live.base_url)
                assert status == 503
                assert waited < AUDIT_TIMEOUT_S + SLACK_S
                headers = {"authorization": f"Bearer {live.keys['app']}"}
                body = {"model": "target", "prompt": "hi", "max_tokens": 2}
                refused = httpx.post(
                    live.base_url + "/v1/completions", json=body, headers=headers, timeout=30
                )
                assert refused.status_code == 503
            deadline = time.monotonic() + 10
            while readyz(live.base_url)[0] != 200:
                assert time.monotonic() < deadline, "readiness did not recover"
                time.sleep(0.2)
