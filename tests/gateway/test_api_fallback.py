"""Fallback behind the gateway judges whether speculation pays: n-gram lookup at about 40 %
acceptance of long proposals stays on (it costs next to nothing, so it still pays), while a
draft model at about 40 %, whose pass costs about a target pass, is switched off by the 60 %
rule that model-based proposers keep, with the figures of that decision in the audit log and
in /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import torch
from prometheus_client.parser import text_string_to_metric_families

from gateway.audit.schema import audit_events
from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_noisy_copy, build_pair

MODEL = "target"
WINDOW = 64


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("fallback")
    target, _ = build_pair(root / "models")
    # As large as the target, so one draft pass costs about one target pass; noise 0.2
    # makes it agree with the target on about 40 % of its proposals.
    draft = build_noisy_copy(target, root / "models" / "costly", noise=0.2)
    with fresh_database() as (name, url):
        settings = gateway_settings(
            (target, draft), root / "data", url, fallback_window_tokens=WINDOW, cpu_threads=1
        )
        with live_gateway(settings, name) as running:
            yield running


def complete(live: LiveGateway, prompt: list[int], method: str, k: int) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 48,
        "temperature": 0.0,
        "speculative": {"method": method, "num_speculative_tokens": k},
    }
    headers = {"authorization": f"Bearer {live.keys['app']}"}
    response = httpx.post(live.base_url + "/v1/completions", json=body, headers=headers,
                          timeout=60)
    assert response.status_code == 200, response.text
    speculative: dict[str, Any] = response.json()["speculative"]
    return speculative


def fallback_events(live: LiveGateway) -> list[dict[str, Any]]:
    with live.services.db.connect() as connection:
        rows = connection.execute(
            sa.select(audit_events.c.payload)
            .where(audit_events.c.kind == "fallback")
            .order_by(audit_events.c.seq)
        )
        return [dict(row.payload) for row in rows]


def disabled_gauge(live: LiveGateway, method: str) -> float:
    text = httpx.get(live.base_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "specgate_speculation_disabled" and sample.labels == {
                "method": method, "model": MODEL
            }:
                return sample.value
    raise AssertionError(f"no specgate_speculation_disabled sample for {method}")


def prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 300, (24,), generator=generator).tolist() for _ in range(count)]


def test_cheap_ngram_stays_on_and_a_costly_draft_goes_off_at_the_same_acceptance(
    live: LiveGateway,
) -> None:
    ngram = [complete(live, prompt, "ngram", 8) for prompt in prompts(8)]
    proposed = sum(s["num_draft_tokens"] for s in ngram)
    accepted = sum(s["num_accepted_tokens"] for s in ngram)
    assert proposed > 4 * WINDOW  # the window filled and was judged several times
    assert 0.25 < accepted / proposed < 0.55  # below the seed's 60 % rule
    assert not any(s["fallback_active"] for s in ngram)
    figures = live.engine._monitor.figures("ngram")
    assert figures.speedup is not None and figures.speedup > 1.0
    assert not [e for e in fallback_events(live) if e["method"] == "ngram"]
    assert disabled_gauge(live, "ngram") == 0

    draft = [complete(live, prompt, "draft", 4) for prompt in prompts(8)]
    assert draft[-1]["fallback_active"]  # switched off before the last request
    [event] = [e for e in fallback_events(live) if e["method"] == "draft"]
    assert event["action"] == "disabled" and event["threshold"] == 0.6
    assert 0.2 < event["acceptance_rate"] < 0.6
    assert "below 0.600" in event["reason"]  # the acceptance rule, a count, decided
    # The timed figures are recorded beside it; their values depend on how busy the machine
    # is (CI once measured a cost ratio of 0.44), so only test_engine_fallback, with pass
    # costs it sets, asserts them.
    assert event["cost_ratio"] > 0 and event["speedup_estimate"] > 0
    assert event["min_speedup"] == 1.0
    assert disabled_gauge(live, "draft") == 1
    assert disabled_gauge(live, "ngram") == 0
