"""The Grafana dashboard and the operations guide name only metrics the gateway exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from gateway.observability.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "specgate-dashboard.json"
OPERATIONS = ROOT / "docs" / "operations.md"
METRIC_NAME = re.compile(r"\bspecgate_[a-z_]+\b")


def exposed_names() -> set[str]:
    """Every sample name the registry can expose (``_total``, ``_bucket``, ... included)."""
    names: set[str] = set()
    for collector in Metrics().registry.collect():
        names.add(collector.name)
        kind = collector.type
        if kind == "counter":
            names.add(f"{collector.name}_total")
        elif kind == "histogram":
            names.update(f"{collector.name}_{s}" for s in ("bucket", "count", "sum"))
    return names


def test_dashboard_panels_query_existing_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {
        "Acceptance rate",
        "Mean acceptance length",
        "Speculation switched off (fallback)",
        "Generated tokens/s",
        "Time to first token",
        "Queue depth",
        "Audit write latency",
    } <= titles
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
    assert used <= exposed_names(), used - exposed_names()
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


def test_operations_guide_documents_every_metric() -> None:
    text = OPERATIONS.read_text()
    documented = set(METRIC_NAME.findall(text))
    families = {
        f"{c.name}_total" if c.type == "counter" else c.name for c in Metrics().registry.collect()
    }
    assert families <= documented, families - documented
    assert documented <= exposed_names(), documented - exposed_names()
    assert (
        "rate(specgate_spec_decode_num_accepted_tokens_total[5m]) / "
        "rate(specgate_spec_decode_num_draft_tokens_total[5m])"
    ) in text
