"""Acceptance drift: each method's rolling acceptance rate over its newest requests, against
what a tuning report measured (the recommendation's assumption) and against the 60 % floor.

Two watchers share these definitions (``Rolling``, ``Drift``, ``Expectations``):
``specgate tune watch`` reads the newest completions of the audit log per model and method
(``rolling_acceptance``), and the running gateway keeps a window per model, method and
workload (``LiveDrift``, fed every finished request). A drift is a structured log line
(``acceptance_drift``) and Prometheus gauges: in a textfile for node-exporter's textfile
collector (``tune watch``), on the gateway's /metrics and, when it starts, an
``acceptance_drift`` audit event (the gateway).

Completion events hold the acceptance figures (draft and accepted tokens per request) and no
content, so watching reads no stored text. The engine's own ``FallbackMonitor``
(``engine.speculation.adaptive``) switches a method off when speculating stops paying; this
says earlier, and for each model, that the traffic has moved away from what was measured.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import structlog

from engine.api.types import GenerationStats
from gateway.audit.schema import audit_events
from gateway.tune.recommend import ACCEPTANCE_FLOOR, expected_acceptance

log = structlog.get_logger(__name__)

PAGE = 1000
# How far below the measured acceptance the rolling rate may fall before it is a drift.
DEFAULT_MARGIN = 0.1
# Draft tokens per model and method (and workload, in the gateway) in the rolling window.
DEFAULT_WINDOW_TOKENS = 2000


@dataclass(frozen=True)
class Rolling:
    """The newest requests of a model and method (and, in the gateway, of one workload):
    ``drafts`` of their ``passes`` target passes proposed ``draft_tokens`` tokens, of which
    ``accepted_tokens`` were kept."""

    model: str
    method: str
    requests: int
    draft_tokens: int
    accepted_tokens: int
    drafts: int = 0
    passes: int = 0
    workload: str | None = None

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


def _figures(spec: dict[str, Any]) -> tuple[int, int, int, int]:
    """A request's draft tokens, accepted tokens, proposing passes and target passes."""
    return (
        int(spec.get("num_draft_tokens") or 0),
        int(spec.get("num_accepted_tokens") or 0),
        int(spec.get("num_drafts") or 0),
        int(spec.get("num_target_passes") or 0),
    )


def rolling_acceptance(
    db: sa.Engine, window_tokens: int, max_events: int = 20 * PAGE
) -> list[Rolling]:
    """Per model and method, the newest completions' acceptance over at least
    ``window_tokens`` draft tokens (fewer where the log holds fewer); reads at most
    ``max_events`` completion events."""
    columns = audit_events.c
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
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
                for index, count in enumerate(_figures(spec), start=1):
                    total[index] += count
            if totals and all(t[1] >= window_tokens for t in totals.values()):
                break
    return [
        Rolling(model, method, n, drafted, accepted, drafts, passes)
        for (model, method), (n, drafted, accepted, drafts, passes) in sorted(totals.items())
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


class Expectations:
    """The acceptance a tuning report measured, per model, workload cluster and method
    (``expected_acceptance``). A report measured on one model covers the traffic of that
    model under any name."""

    def __init__(self, report: dict[str, Any]) -> None:
        measured = [m for m in report["models"] if m["clusters"]]
        self._models = {
            m["name"]: {c["cluster"]: expected_acceptance(m, c["cluster"]) for c in m["clusters"]}
            for m in measured
        }
        self._only = next(iter(self._models.values())) if len(self._models) == 1 else None

    def of(self, model: str, method: str, workload: str | None = None) -> float | None:
        """What the report measured for the method on the workload's own cluster where it
        has one, else on all of the model's traffic; None where it did not measure it (then
        the floor alone applies)."""
        clusters = self._models.get(model, self._only) or {}
        own = clusters.get(workload, {}) if workload is not None else {}
        return own.get(method, clusters.get("all", {}).get(method))


def drifts(
    rolling: list[Rolling],
    report: dict[str, Any],
    floor: float = ACCEPTANCE_FLOOR,
    margin: float = DEFAULT_MARGIN,
) -> list[Drift]:
    """Each rolling figure against the report's measured acceptance for its model and
    method (``Expectations``)."""
    expected = Expectations(report)
    return [
        Drift(each, expected.of(each.model, each.method, each.workload), floor, margin)
        for each in rolling
    ]


@dataclass(frozen=True)
class Judged:
    """A window after one more request: the drift figures once the window is full (None
    before), and whether a drift started with this request."""

    rolling: Rolling
    drift: Drift | None
    started: bool


class LiveDrift:
    """The running gateway's windows: per model, method and workload, the newest speculated
    requests over ``window_tokens`` draft tokens (the oldest dropped while the rest still
    hold that many, as the fallback's window does). A full window is judged as ``drifts``
    judges (``Drift``); ``observe`` says when a drift starts, once, until the rate recovers.
    Not thread-safe: the gateway feeds it from its event loop."""

    def __init__(
        self,
        expected: Expectations,
        window_tokens: int = DEFAULT_WINDOW_TOKENS,
        margin: float = DEFAULT_MARGIN,
        floor: float = ACCEPTANCE_FLOOR,
    ) -> None:
        self.expected = expected
        self.window_tokens = window_tokens
        self.margin = margin
        self.floor = floor
        self._windows: dict[tuple[str, str, str], deque[tuple[int, int, int, int]]] = {}
        self._drifting: set[tuple[str, str, str]] = set()

    def observe(self, model: str, workload: str, stats: GenerationStats) -> Judged | None:
        """Add one finished request; None where it did not speculate."""
        spec = stats.speculation()
        if not _speculated(spec):
            return None
        key = (model, str(spec["method"]), workload)
        window = self._windows.setdefault(key, deque())
        window.append(_figures(spec))
        total = sum(entry[0] for entry in window)
        while total - window[0][0] >= self.window_tokens:
            total -= window.popleft()[0]
        counts = [sum(entry[i] for entry in window) for i in range(4)]
        rolling = Rolling(model, key[1], len(window), counts[0], counts[1], counts[2],
                          counts[3], workload)
        if rolling.draft_tokens < self.window_tokens:
            return Judged(rolling, None, False)
        drift = Drift(
            rolling, self.expected.of(model, key[1], workload), self.floor, self.margin
        )
        was = key in self._drifting
        if drift.drifting:
            self._drifting.add(key)
        else:
            self._drifting.discard(key)
        return Judged(rolling, drift, drift.drifting and not was)


def drift_record(drift: Drift) -> dict[str, Any]:
    """A drift's figures: its log line's fields, and the gateway's `acceptance_drift` event."""
    rolling = drift.rolling
    record: dict[str, Any] = {"model": rolling.model, "method": rolling.method}
    if rolling.workload is not None:
        record["workload"] = rolling.workload
    return {
        **record,
        "rolling_acceptance": round(rolling.acceptance, 4),
        "expected_acceptance": drift.expected,
        "floor": drift.floor,
        "margin": drift.margin,
        "draft_tokens": rolling.draft_tokens,
        "requests": rolling.requests,
        "reason": "; ".join(drift.reasons),
    }


def announce(found: list[Drift]) -> None:
    """One structured log line per drifting method."""
    for drift in found:
        if drift.drifting:
            log.warning("acceptance_drift", **drift_record(drift))


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


# The newest gateway-recorded drifts a tuning report lists.
REPORTED_DRIFTS = 50


def recorded_drifts(db: sa.Engine, limit: int = REPORTED_DRIFTS) -> list[dict[str, Any]]:
    """The newest `acceptance_drift` events the gateways appended (newest first): when, and
    the drift's figures (``drift_record``'s fields and the instance); no content."""
    c = audit_events.c
    query = (
        sa.select(c.event_id, c.created_at, c.payload)
        .where(c.kind == "acceptance_drift")
        .order_by(c.seq.desc())
        .limit(limit)
    )
    with db.connect() as connection:
        rows = connection.execute(query).all()
    return [
        {"event_id": row.event_id, "created_at": str(row.created_at), **dict(row.payload)}
        for row in rows
    ]
