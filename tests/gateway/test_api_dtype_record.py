"""Which dtype the target is served in, and why, is on record: in the `startup` audit event
and in `GET /v1/models` (for `auto`, with the CPU seconds it measured per candidate)."""

from __future__ import annotations

from pathlib import Path

import httpx
import sqlalchemy as sa

from gateway.audit.schema import audit_events
from gateway.db import make_db_engine
from tests.api_harness import fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_pair


def test_the_served_dtype_and_why_are_recorded_and_listed(tmp_path: Path) -> None:
    models = build_pair(tmp_path / "models")
    with fresh_database() as (name, url):
        settings = gateway_settings(models, tmp_path / "data", url).model_copy(
            update={"dtype": "auto"}
        )
        with live_gateway(settings, name) as live:
            headers = {"authorization": f"Bearer {live.keys['app']}"}
            listed = httpx.get(live.base_url + "/v1/models", headers=headers, timeout=30)
        expected = {
            "requested": "auto",
            "chosen": "float32",
            "reason": "a small model is not memory-bound",
            "measured_cpu_s": {},
        }
        assert listed.json()["data"][0]["dtype"] == expected
        db = make_db_engine(url)
        with db.connect() as connection:
            startup = connection.execute(
                sa.select(audit_events.c.payload).where(audit_events.c.kind == "startup")
            ).scalar_one()
        db.dispose()
        assert startup["dtype"] == expected
