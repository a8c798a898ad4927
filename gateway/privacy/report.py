"""The compliance report (``specgate compliance report``): one self-contained HTML page a data
protection officer can attach to the records of processing (revDSG Art. 12).

It is read from the audit log alone (plus the key table): requests, acceptance rate and
fallback events over time (inline SVG charts drawn with matplotlib, no script, nothing
loaded from elsewhere), the model and artefact versions in service, keys and roles,
erasures, retention actions and legal holds, and the chain and checkpoint verification.
"""

from __future__ import annotations

import html
import io
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from gateway.audit.canonical import format_timestamp
from gateway.audit.schema import api_keys, audit_events
from gateway.audit.verify import VerifyReport
from gateway.recording import recorded_artefacts

_KINDS = (
    "request",
    "completion",
    "fallback",
    "startup",
    "erasure",
    "legal_hold",
    "checkpoint",
    "cosignature",
    "tamper_detected",
    "replay",
)


@dataclass
class ReportData:
    since: datetime
    until: datetime
    bucket: timedelta
    requests: Counter[datetime] = field(default_factory=Counter)
    draft_tokens: Counter[datetime] = field(default_factory=Counter)
    accepted_tokens: Counter[datetime] = field(default_factory=Counter)
    fallbacks: Counter[datetime] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    requests_by_key: Counter[str] = field(default_factory=Counter)
    # (model, target version, artefacts) -> [first seen, requests served]
    versions: dict[tuple[Any, ...], list[Any]] = field(default_factory=dict)
    fallback_events: list[dict[str, Any]] = field(default_factory=list)
    erasures: list[dict[str, Any]] = field(default_factory=list)
    holds: list[dict[str, Any]] = field(default_factory=list)
    replays: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: int = 0
    latest_checkpoint_size: int | None = None
    cosignatures: int = 0
    tamper: list[dict[str, Any]] = field(default_factory=list)
    keys: list[dict[str, Any]] = field(default_factory=list)
    verification: VerifyReport | None = None
    verification_note: str = ""

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def acceptance_rate(self) -> float | None:
        drafted = sum(self.draft_tokens.values())
        return sum(self.accepted_tokens.values()) / drafted if drafted else None


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _bucket_of(moment: datetime, since: datetime, bucket: timedelta) -> datetime:
    return since + bucket * ((moment - since) // bucket)


def collect(db: sa.Engine, since: datetime, until: datetime) -> ReportData:
    """The figures of the events created in [since, until) and the keys as they are now."""
    since, until = _utc(since), _utc(until)
    bucket = timedelta(hours=1) if until - since <= timedelta(days=2) else timedelta(days=1)
    data = ReportData(since, until, bucket)
    events = audit_events.c
    query = (
        sa.select(events.created_at, events.kind, events.actor, events.payload)
        .where(events.created_at >= since, events.created_at < until, events.kind.in_(_KINDS))
        .order_by(events.seq)
    )
    with db.connect() as connection:
        for created_at, kind, actor, payload in connection.execute(
            query.execution_options(yield_per=2000)
        ):
            _count(data, _utc(created_at), kind, actor, payload)
        for row in connection.execute(sa.select(api_keys).order_by(api_keys.c.created_at)):
            data.keys.append(
                {
                    "key_id": row.key_id,
                    "name": row.name,
                    "role": row.role,
                    "created_at": format_timestamp(row.created_at),
                    "revoked_at": format_timestamp(row.revoked_at) if row.revoked_at else "",
                }
            )
    return data


def _count(
    data: ReportData, moment: datetime, kind: str, actor: str | None, payload: dict[str, Any]
) -> None:
    slot = _bucket_of(moment, data.since, data.bucket)
    when = format_timestamp(moment)
    if kind in ("request", "startup"):
        artefacts = ", ".join(
            f"{a.get('kind')} {a.get('name')} {a.get('version')}"
            for a in recorded_artefacts(payload)
        )
        version = (payload.get("model"), payload.get("target_version"), artefacts)
        seen = data.versions.setdefault(version, [when, 0])
        seen[1] += kind == "request"
    if kind == "request":
        data.requests[slot] += 1
        data.requests_by_key[str(payload.get("key_name"))] += 1
    elif kind == "completion":
        data.outcomes[str(payload.get("outcome"))] += 1
        speculative = payload.get("speculative") or {}
        data.draft_tokens[slot] += int(speculative.get("num_draft_tokens") or 0)
        data.accepted_tokens[slot] += int(speculative.get("num_accepted_tokens") or 0)
    elif kind == "fallback":
        data.fallbacks[slot] += 1
        data.fallback_events.append({"at": when, **payload})
    elif kind == "erasure":
        data.erasures.append({"at": when, "actor": actor, **payload})
    elif kind == "legal_hold":
        data.holds.append({"at": when, "actor": actor, **payload})
    elif kind == "replay":
        data.replays.append({"at": when, "actor": actor, **payload})
    elif kind == "checkpoint":
        data.checkpoints += 1
        data.latest_checkpoint_size = payload.get("size", data.latest_checkpoint_size)
    elif kind == "cosignature":
        data.cosignatures += 1
    elif kind == "tamper_detected":
        data.tamper.append({"at": when, **payload})


# --- rendering ---------------------------------------------------------------------------


def _svg_chart(title: str, series: dict[datetime, float], ylabel: str, kind: str = "bar") -> str:
    """A small chart as inline SVG (no fonts or scripts fetched)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text stays text: searchable, no glyph paths
    figure, axes = plt.subplots(figsize=(7.5, 2.6), dpi=100)
    try:
        slots = sorted(series)
        labels = [slot.strftime("%m-%d %H:%M") for slot in slots]
        values = [series[slot] for slot in slots]
        if kind == "bar":
            axes.bar(range(len(values)), values, color="#3465a4")
            axes.set_ylim(0, max([1.0, *values]) * 1.1)
        else:
            axes.plot(range(len(values)), values, marker="o", color="#4e9a06")
            axes.set_ylim(0, 1)
        axes.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=7)
        axes.set_title(title, fontsize=10)
        axes.set_ylabel(ylabel, fontsize=8)
        axes.grid(axis="y", alpha=0.3)
        figure.tight_layout()
        buffer = io.StringIO()
        figure.savefig(buffer, format="svg")
    finally:
        plt.close(figure)
    svg = buffer.getvalue()
    return svg[svg.index("<svg") :]


def _slots(data: ReportData) -> list[datetime]:
    present = set(data.requests) | set(data.fallbacks) | set(data.draft_tokens)
    return sorted(present) or [data.since]


def _table(headers: list[str], rows: list[list[Any]], empty: str) -> str:
    if not rows:
        return f"<p class='empty'>{html.escape(empty)}</p>"
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_STYLE = """
body { font-family: sans-serif; margin: 2em; color: #222; max-width: 60em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; overflow-wrap: anywhere; }
th { background: #f0f0f0; } .figure { font-size: 1.6em; font-weight: bold; }
.ok { color: #2e7d32; font-weight: bold; } .bad { color: #c62828; font-weight: bold; }
.empty { color: #777; font-style: italic; } .cards { display: flex; gap: 2em; }
"""


def render_html(data: ReportData, generated_at: datetime | None = None) -> str:
    generated_at = generated_at or datetime.now(UTC)
    slots = _slots(data)
    requests = {slot: float(data.requests[slot]) for slot in slots}
    fallbacks = {slot: float(data.fallbacks[slot]) for slot in slots}
    acceptance = {
        slot: data.accepted_tokens[slot] / data.draft_tokens[slot]
        for slot in slots
        if data.draft_tokens[slot]
    }
    rate = data.acceptance_rate
    verification = data.verification
    if verification is None:
        status = f"<span class='bad'>not verified</span>: {html.escape(data.verification_note)}"
    elif verification.ok:
        status = f"<span class='ok'>verified</span>: {html.escape(verification.reason)}"
    else:
        status = (
            f"<span class='bad'>FAILED</span> at event {verification.first_bad_seq}: "
            f"{html.escape(verification.reason)}"
        )
    retention = [e for e in data.erasures if e.get("cause") == "retention"]
    subject = [e for e in data.erasures if e.get("cause") != "retention"]
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<title>Specgate compliance report</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>Specgate: records of processing (revDSG Art. 12)</h1>",
        f"<p>Period: {format_timestamp(data.since)} to {format_timestamp(data.until)} "
        f"(UTC). Generated {format_timestamp(generated_at)} from the audit log.</p>",
        "<div class='cards'>",
        f"<div>Requests<div class='figure' id='requests'>{data.total_requests}</div></div>",
        "<div>Acceptance rate<div class='figure' id='acceptance'>"
        + ("n/a" if rate is None else f"{rate:.1%}")
        + "</div></div>",
        "<div>Fallback events<div class='figure' id='fallbacks'>"
        f"{sum(data.fallbacks.values())}</div></div>",
        f"<div>Erasures<div class='figure' id='erasures'>{len(data.erasures)}</div></div>",
        "</div>",
        "<h2>Chain and checkpoint verification</h2>",
        f"<p id='verification'>{status}</p>",
        f"<p>Signed checkpoints in the period: {data.checkpoints}"
        + (
            f" (latest tree size {data.latest_checkpoint_size})"
            if data.latest_checkpoint_size is not None
            else ""
        )
        + f"; witness cosignatures: {data.cosignatures}; "
        f"tamper alarms: {len(data.tamper)}.</p>",
        "<h2>Requests over time</h2>",
        _svg_chart("Requests", requests, "requests"),
        _table(
            ["key", "requests"],
            [[name, count] for name, count in data.requests_by_key.most_common()],
            "No requests in the period.",
        ),
        _table(
            ["outcome", "completions"],
            [[name, count] for name, count in data.outcomes.most_common()],
            "No completions in the period.",
        ),
        "<h2>Speculative decoding: acceptance and fallbacks</h2>",
        _svg_chart(
            "Acceptance rate", acceptance or {data.since: 0.0}, "accepted / drafted", "line"
        ),
        _svg_chart("Fallback events", fallbacks, "events"),
        _table(
            ["at", "method", "action", "reason"],
            [
                [e["at"], e.get("method"), e.get("action"), e.get("reason")]
                for e in data.fallback_events
            ],
            "No fallback events in the period.",
        ),
        "<h2>Models and artefacts in service</h2>",
        _table(
            ["model", "target version", "artefacts", "first seen", "requests"],
            [[*version, first, count] for version, (first, count) in data.versions.items()],
            "No model served or started in the period.",
        ),
        "<h2>Keys and roles</h2>",
        _table(
            ["key id", "holder", "role", "created", "revoked"],
            [
                [k["key_id"], k["name"], k["role"], k["created_at"], k["revoked_at"]]
                for k in data.keys
            ],
            "No keys.",
        ),
        "<h2>Erasures (data subject requests)</h2>",
        _table(
            ["at", "by", "subject (keyed reference)", "outcome", "keys destroyed"],
            [
                [e["at"], e["actor"], e.get("subject_ref"), e.get("outcome"), len(e["key_refs"])]
                for e in subject
            ],
            "No erasures in the period.",
        ),
        "<h2>Retention actions</h2>",
        _table(
            ["at", "key", "key created", "retention (days)"],
            [
                [
                    e["at"],
                    ", ".join(e["key_refs"]),
                    e.get("key_created_at"),
                    e.get("retention_days"),
                ]
                for e in retention
            ],
            "No content keys expired in the period.",
        ),
        "<h2>Legal holds</h2>",
        _table(
            ["at", "by", "subject (keyed reference)", "action"],
            [[e["at"], e["actor"], e.get("subject_ref"), e.get("action")] for e in data.holds],
            "No legal holds placed or released in the period.",
        ),
        "<h2>Replays</h2>",
        _table(
            ["at", "by", "request event", "replayed", "match"],
            [
                [e["at"], e["actor"], e["request_event_id"], e["replayed"], e["match"]]
                for e in data.replays
            ],
            "No replays in the period.",
        ),
        "<p>Subjects are named by keyed reference only; prompt and completion text is never in "
        "the log (docs/compliance.md).</p></body></html>",
    ]
    return "".join(parts)
