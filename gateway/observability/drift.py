"""Acceptance drift watched by the running gateway.

Every finished request that speculated goes into its model's, method's and workload's window
(``gateway.tune.watch.LiveDrift``: the definitions ``specgate tune watch`` uses). The window's
rate, what the applied tuning report (setting ``tune_report``) measured, the estimated speedup
and the drift flag are gauges on /metrics; when a drift starts, not on every request while it
lasts, an ``acceptance_drift`` log line and audit event. The workload is the request's route
and its API key's name, the cluster ``specgate tune measure`` reports
(``gateway.tune.sample.cluster_of``): operators create keys, so the labels stay few.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from engine.api.types import GenerationStats
from gateway.backends.base import SpeedupEstimate
from gateway.observability.metrics import Metrics
from gateway.settings import ConfigError
from gateway.tune.watch import Expectations, LiveDrift, drift_record

log = structlog.get_logger(__name__)


def load_expectations(report: Path | None) -> Expectations:
    """What the tuning report at ``report`` measured; nothing without one (the floor alone
    then judges). Raises ConfigError where it cannot be read."""
    if report is None:
        return Expectations({"models": []})
    try:
        return Expectations(json.loads(report.read_text("utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"tune_report: cannot read {report}: {error}") from None


class AcceptanceWatch:
    """Feeds the windows, sets the gauges and reports each drift that starts to ``record``
    (which appends the audit event). ``speedups``: per model, its backend's estimate (None
    where the backend offers none). Runs on the event loop."""

    def __init__(
        self,
        windows: LiveDrift,
        metrics: Metrics,
        speedups: Mapping[str, SpeedupEstimate | None],
        record: Callable[[dict[str, Any]], object],
    ) -> None:
        self.windows = windows
        self.metrics = metrics
        self.speedups = dict(speedups)
        self.record = record

    def observe(self, model: str, workload: str, stats: GenerationStats) -> None:
        judged = self.windows.observe(model, workload, stats)
        if judged is None:
            return
        rolling = judged.rolling
        estimate = self.speedups.get(model)
        speedup = (
            None
            if estimate is None
            else estimate(
                stats.method,
                rolling.draft_tokens,
                rolling.accepted_tokens,
                rolling.drafts,
                rolling.passes,
            )
        )
        drift = judged.drift
        self.metrics.observe_acceptance(
            rolling.method,
            model,
            workload,
            rolling.acceptance,
            self.windows.expected.of(model, rolling.method, workload),
            speedup,
            drift is not None and drift.drifting,
        )
        if judged.started and drift is not None:
            event = {**drift_record(drift), "estimated_speedup": speedup}
            log.warning("acceptance_drift", **event)
            self.record(event)
