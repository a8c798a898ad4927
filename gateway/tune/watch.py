"""Acceptance drift: each method's rolling acceptance rate over the newest completions in the
audit log, against what a tuning report measured (the recommendation's assumption) and
against the 60 % floor. A drift is a structured log line (``acceptance_drift``) and, where
asked, Prometheus gauges in a textfile for node-exporter's textfile collector.

Completion events hold the acceptance figures (draft and accepted tokens per request) and no
content, so watching reads no stored text. The engine's own ``FallbackMonitor``
(``engine.speculation.adaptive``) switches a method off when speculating stops paying; this
says earlier, and for each model, that the traffic has moved away from what was measured.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import structlog

from gateway.audit.schema import audit_events
from gateway.tune.recommend import ACCEPTANCE_FLOOR, expected_acceptance

log = structlog.get_logger(__name__)

PAGE = 1000
# How far below the measured acceptance the rolling rate may fall before it is a drift.
DEFAULT_MARGIN = 0.1


@dataclass(frozen=True)
class Rolling:
    model: str
    method: str
    requests: int
    draft_tokens: int
    accepted_tokens: int

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass(frozen=True)
class Drift:
    rolling: Rolling
    expected: float | None
    floor: float
    margin: float

    @property
    def reasons(self) -> list[str]:
        found = []
        rate = self.rolling.acceptance
        if rate < self.floor:
            found.append(f"below the {self.floor:.0%} floor")
        if self.expected is not None and rate < self.expected - self.margin:
            found.append(f"below the measured {self.expected:.0%} by more than {self.margin:.0%}")
        return found

    @property
    def drifting(self) -> bool:
        return bool(self.reasons)


def rolling_acceptance(
    db: sa.Engine, window_tokens: int, max_events: int = 20 * PAGE
) -> list[Rolling]:
    """Per model and method, the newest completions' acceptance over at least
    ``window_tokens`` draft tokens (fewer where the log holds fewer); reads at most
    ``max_events`` completion events."""
    columns = audit_events.c
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    before: int | None = None
    read = 0
    with db.connect() as connection:
        while read < max_events:
            query = sa.select(columns.seq, columns.payload).where(columns.kind == "completion")
            if before is not None:
                query = query.where(columns.seq < before)
            rows = connection.execute(query.order_by(columns.seq.desc()).limit(PAGE)).all()
            if not rows:
                break
            read += len(rows)
            before = rows[-1].seq
            figures = [(row.payload, row.payload.get("speculative")) for row in rows]
            wanted = [p["request_event_id"] for p, s in figures if _speculated(s)]
            models = _models_of(connection, wanted)
            for payload, spec in figures:
                if not _speculated(spec):
                    continue
                model = models.get(payload["request_event_id"], "?")
                total = totals[(model, str(spec["method"]))]
                if total[1] >= window_tokens:
                    continue
                total[0] += 1
                total[1] += int(spec.get("num_draft_tokens") or 0)
                total[2] += int(spec.get("num_accepted_tokens") or 0)
            if totals and all(t[1] >= window_tokens for t in totals.values()):
                break
    return [
        Rolling(model, method, *counts) for (model, method), counts in sorted(totals.items())
    ]


def _speculated(spec: Any) -> bool:
    return (
        isinstance(spec, dict)
        and spec.get("method") not in (None, "none")
        and bool(spec.get("num_draft_tokens"))
    )


def _models_of(connection: sa.Connection, event_ids: list[str]) -> dict[str, str]:
    if not event_ids:
        return {}
    rows = connection.execute(
        sa.select(audit_events.c.event_id, audit_events.c.payload).where(
            audit_events.c.event_id.in_(sorted(set(event_ids)))
        )
    ).all()
    return {row.event_id: str(row.payload.get("model")) for row in rows}


def drifts(
    rolling: list[Rolling],
    report: dict[str, Any],
    floor: float = ACCEPTANCE_FLOOR,
    margin: float = DEFAULT_MARGIN,
) -> list[Drift]:
    """Each rolling figure against the report's measured acceptance for its model and
    method (none where the report did not measure it: then the floor alone applies). A
    report measured on one model covers the traffic of that model under any name."""
    expected = {m["name"]: expected_acceptance(m) for m in report["models"] if m["clusters"]}
    only = next(iter(expected.values())) if len(expected) == 1 else None
    found = []
    for each in rolling:
        measured = expected.get(each.model, only) or {}
        found.append(Drift(each, measured.get(each.method), floor, margin))
    return found


def announce(found: list[Drift]) -> None:
    """One structured log line per drifting method."""
    for drift in found:
        if drift.drifting:
            log.warning(
                "acceptance_drift",
                model=drift.rolling.model,
                method=drift.rolling.method,
                rolling_acceptance=round(drift.rolling.acceptance, 4),
                expected_acceptance=drift.expected,
                floor=drift.floor,
                draft_tokens=drift.rolling.draft_tokens,
                requests=drift.rolling.requests,
                reasons=drift.reasons,
            )


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def metrics_text(found: list[Drift]) -> str:
    """Prometheus text exposition of the rolling and expected acceptance and the drift flag."""
    lines = [
        "# HELP specgate_tune_rolling_acceptance Rolling acceptance rate over the newest "
        "completions.",
        "# TYPE specgate_tune_rolling_acceptance gauge",
        "# HELP specgate_tune_expected_acceptance Acceptance rate the tuning report measured.",
        "# TYPE specgate_tune_expected_acceptance gauge",
        "# HELP specgate_tune_acceptance_drift 1 while the rolling acceptance is below the "
        "measured one (less the margin) or the floor.",
        "# TYPE specgate_tune_acceptance_drift gauge",
    ]
    for drift in found:
        labels = (
            f'model="{_label(drift.rolling.model)}",method="{_label(drift.rolling.method)}"'
        )
        lines.append(f"specgate_tune_rolling_acceptance{{{labels}}} {drift.rolling.acceptance:.6g}")
        if drift.expected is not None:
            lines.append(f"specgate_tune_expected_acceptance{{{labels}}} {drift.expected:.6g}")
        lines.append(f"specgate_tune_acceptance_drift{{{labels}}} {int(drift.drifting)}")
    return "\n".join(lines) + "\n"


def write_metrics(path: Path, found: list[Drift]) -> None:
    """Write atomically (the collector must never read half a file)."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(metrics_text(found), "utf-8")
    partial.replace(path)
