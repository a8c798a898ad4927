"""Acceptance drift watched by the running gateway: per model, method and workload (the
route and the key's name, `tune measure`'s cluster) the rolling acceptance over a window of
draft tokens, what the applied tuning report measured, the estimated speedup and a drift flag
on /metrics; an `acceptance_drift` log line and audit event when a drift starts (not on every
request), listed by the compliance report.

n-gram lookup on random token prompts accepts 20-80 % of long proposals (about 40 % over a
few requests). The report says
the model's traffic measured 90 % (so a workload it did not measure on its own drifts), and
that one application's own cluster measured 30 % (so that one does not)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import torch
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from engine.api.types import GenerationStats
from gateway.audit.schema import audit_events
from gateway.privacy.report import collect
from gateway.privacy.report_html import render_html
from gateway.tune.watch import Expectations, LiveDrift
from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_pair

MODEL = "target"
WINDOW = 128
ROUTE = "/v1/completions"
DRIFTING = f"{ROUTE} drifting-app"
CALM = f"{ROUTE} calm-app"


def _cluster(name: str, acceptance: float) -> dict[str, Any]:
    row = {"variant": "ngram k=8", "method": "ngram", "k": 8, "speedup": 1.4,
           "acceptance_rate": acceptance}
    return {"cluster": name, "requests": 4, "rows": [row],
            "recommendation": {"verdict": "on", "method": "ngram", "k": 8}}


def _report(path: Path) -> Path:
    """A tuning report (the parts drift reads): n-gram at 90 % on all of the model's
    traffic, at 30 % on the calm application's own."""
    report = {"models": [{
        "name": MODEL,
        "recommendation": {"verdict": "on", "method": "ngram", "k": 8},
        "clusters": [_cluster("all", 0.9), _cluster(CALM, 0.3)],
    }]}
    path.write_text(json.dumps(report))
    return path


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("drift")
    models = build_pair(root / "models")
    with fresh_database() as (name, url):
        settings = gateway_settings(
            models, root / "data", url,
            tune_report=_report(root / "tune.json"), drift_window_tokens=WINDOW, drift_floor=0.0,
            fallback_min_speedup=0.0, cpu_threads=1,
        )
        with live_gateway(settings, name) as running:
            yield running


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (24,), generator=generator).tolist() for _ in range(count)]


def _complete(live: LiveGateway, key: str, prompt: list[int]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 48, "temperature": 0.0,
            "speculative": {"method": "ngram", "num_speculative_tokens": 8}}
    response = httpx.post(live.base_url + ROUTE, json=body,
                          headers={"authorization": f"Bearer {key}"}, timeout=60)
    assert response.status_code == 200, response.text


def _gauges(live: LiveGateway, workload: str) -> dict[str, float]:
    text = httpx.get(live.base_url + "/metrics", timeout=30).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels == {"model": MODEL, "method": "ngram", "workload": workload}
    }


def _drift_events(live: LiveGateway) -> list[dict[str, Any]]:
    with live.services.db.connect() as connection:
        rows = connection.execute(
            sa.select(audit_events.c.payload)
            .where(audit_events.c.kind == "acceptance_drift")
            .order_by(audit_events.c.seq)
        )
        return [dict(row.payload) for row in rows]


def _spooled(live: LiveGateway) -> None:
    """Wait until the spool's writer has committed every event handed to it."""
    deadline = time.monotonic() + 20
    while live.services.spool.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.services.spool.pending == 0


@dataclass
class Drifted:
    key: str  # the drifting application's
    logs: list[dict[str, Any]]


@pytest.fixture(scope="module")
def drifted(live: LiveGateway) -> Drifted:
    """Six requests of each application, the logs they wrote, every event committed."""
    keys = live.services.keys
    drifting = keys.create("app", "drifting-app", "tests")[1]
    calm = keys.create("app", "calm-app", "tests")[1]
    with capture_logs() as logs:
        for prompt in _prompts(6, seed=0):
            _complete(live, drifting, prompt)
            _complete(live, calm, prompt)
    _spooled(live)
    return Drifted(drifting, logs)


def test_the_gateway_exposes_drift_per_workload_and_audits_its_start_once(
    live: LiveGateway, drifted: Drifted
) -> None:
    [event] = _drift_events(live)
    assert (event["model"], event["method"], event["workload"]) == (MODEL, "ngram", DRIFTING)
    assert 0.2 < event["rolling_acceptance"] < 0.8
    assert (event["expected_acceptance"], event["floor"], event["margin"]) == (0.9, 0.0, 0.1)
    assert event["draft_tokens"] >= WINDOW
    assert "below the measured 90%" in event["reason"]
    starts = [entry for entry in drifted.logs if entry["event"] == "acceptance_drift"]
    assert [(s["workload"], s["log_level"]) for s in starts] == [(DRIFTING, "warning")]

    gauges = _gauges(live, DRIFTING)
    assert 0.2 < gauges["specgate_acceptance_rolling_rate"] < 0.8
    assert gauges["specgate_acceptance_expected_rate"] == 0.9
    assert gauges["specgate_acceptance_drift"] == 1
    assert gauges["specgate_speculation_estimated_speedup"] > 0
    calm_gauges = _gauges(live, CALM)
    assert calm_gauges["specgate_acceptance_expected_rate"] == 0.3  # its own cluster's
    assert calm_gauges["specgate_acceptance_drift"] == 0

    # The drift lasts: more requests, no second event.
    for prompt in _prompts(3, seed=1):
        _complete(live, drifted.key, prompt)
    _spooled(live)
    assert len(_drift_events(live)) == 1
    assert _gauges(live, DRIFTING)["specgate_acceptance_drift"] == 1


def test_the_compliance_report_lists_acceptance_drift_events(
    live: LiveGateway, drifted: Drifted
) -> None:
    now = datetime.now(UTC)
    data = collect(live.services.db, now - timedelta(hours=1), now + timedelta(hours=1))
    [listed] = data.drift_events
    assert listed["workload"] == DRIFTING
    rows = render_html(data).split("id='acceptance-drift'")[1].split("</table>")[0]
    assert f"<td>{MODEL}</td><td>ngram</td><td>{DRIFTING}</td>" in rows
    assert "below the measured 90%" in rows


def test_the_tune_report_lists_the_recorded_drifts(live: LiveGateway, drifted: Drifted) -> None:
    from gateway.tune.report import render_html as render_tune_html
    from gateway.tune.watch import recorded_drifts

    [listed] = recorded_drifts(live.services.db)
    assert (listed["model"], listed["method"], listed["workload"]) == (MODEL, "ngram", DRIFTING)
    report = {
        "source": {"source": "audit_log"}, "requests": [], "options": {}, "machine": "m",
        "measure_event_id": "e", "created_at": "now", "models": [],
    }  # fmt: skip
    quiet = render_tune_html(report)
    assert "No drift recorded by the gateway" in quiet
    page = render_tune_html({**report, "acceptance_drifts": [listed]})
    section = page.split("id='acceptance-drift'")[1]
    assert f"{MODEL} ngram {DRIFTING}" in section and "below the measured 90%" in section
    assert "specgate tune train" in section


def _stats(accepted: int) -> GenerationStats:
    return GenerationStats(method="ngram", num_drafts=4, num_draft_tokens=16,
                           num_accepted_tokens=accepted, num_target_passes=8)


def test_a_drift_starts_again_only_after_the_rate_recovered() -> None:
    watch = LiveDrift(Expectations({"models": []}), window_tokens=32, margin=0.1, floor=0.6)
    started = []
    for accepted in (2, 2, 2, 2, 16, 16, 16, 2, 2, 2):
        judged = watch.observe(MODEL, DRIFTING, _stats(accepted))
        assert judged is not None
        started.append(judged.started)
    # Judged once the window holds 32 draft tokens (two requests): low from the second
    # (starts), still low while one good request is in it, recovered with two, low again.
    assert started == [False, True, False, False, False, False, False, True, False, False]
