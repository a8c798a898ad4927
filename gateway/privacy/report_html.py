"""The compliance report's page: its head and warnings, Part I (the declared record,
``gateway.privacy.report_declared``) and Part II, the evidence from the audit log, each figure
with the events it was counted from."""

from __future__ import annotations

from datetime import UTC, datetime

from gateway.audit.canonical import format_timestamp
from gateway.privacy.report import ReportData
from gateway.privacy.report_declared import declared_part, missing_record_warning
from gateway.privacy.report_parts import (
    STYLE,
    card,
    esc,
    facts,
    notice,
    source,
    svg_chart,
    table,
    warning,
)


def render_html(data: ReportData, generated_at: datetime | None = None) -> str:
    generated_at = generated_at or datetime.now(UTC)
    return "".join(
        [
            "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
            "<title>Record of processing activities: Specgate LLM gateway</title>",
            f"<style>{STYLE}</style></head><body>",
            "<h1>Record of processing activities</h1>",
            "<p class='subtitle'>Specgate LLM gateway: revDSG Art. 12, GDPR Art. 30. Part I is "
            "the operator's declaration; Part II is the evidence from the audit log.</p>",
            _head(data, generated_at),
            "<div id='warnings'>",
            *_warnings(data, generated_at),
            *_notices(data),
            "</div>",
            declared_part(data.declared, data.declared_changes),
            "<h2 id='evidence'>Part II. Evidence from the audit log</h2>",
            "<p>Every figure below is counted from events of the append-only audit log, never "
            "from tables the database owner can edit; each names its events.</p>",
            _period(data),
            _content_storage(data),
            _requests(data),
            _subject_rights(data),
            _disclosures(data),
            _keys(data),
            _models(data),
            _replays(data),
            _integrity(data),
            "<p>Data subjects are named by keyed reference only; prompt and completion text is "
            "never in the log (docs/compliance.md).</p></body></html>",
        ]
    )


def _seq_range(data: ReportData) -> str:
    if data.first_seq is None:
        return "no events"
    return f"seq {data.first_seq} to {data.last_seq}"


def _head(data: ReportData, generated_at: datetime) -> str:
    declared = data.declared
    record = declared.record if declared is not None else {}
    controller = record.get("controller") or {}
    version = (
        f"audit event seq {declared.seq}, {declared.sha256}, "
        f"recorded {format_timestamp(declared.created_at)}"
        if declared is not None
        else "NONE DECLARED"
    )
    return facts(
        [
            ("Processing activity", record.get("activity", "not declared")),
            ("Controller", controller.get("name", "not declared")),
            ("Declared record", version),
            (
                "Period covered (UTC)",
                f"{format_timestamp(data.since)} to {format_timestamp(data.until)} (exclusive)",
            ),
            ("Audit events in the period", _seq_range(data)),
            ("Generated", f"{format_timestamp(generated_at)}, from the audit log"),
        ]
    )


def _warnings(data: ReportData, now: datetime) -> list[str]:
    found = []
    if data.declared is None:
        found.append(missing_record_warning())
    elif not data.declared.hash_matches:
        found.append(
            warning("declared-hash", "The declared record's hash does not match its content.")
        )
    verification = data.verification
    if verification is None:
        found.append(
            warning("not-verified", f"The audit log was NOT verified: {data.verification_note}")
        )
    elif not verification.ok:
        found.append(
            warning(
                "verification-failed",
                f"VERIFICATION FAILED at event {verification.first_bad_seq}: {verification.reason}",
            )
        )
    cosignature = _cosignature_problem(data, now)
    if cosignature:
        found.append(warning("cosignature-warning", cosignature))
    if data.tamper or data.alarm_standing:
        standing = " An alarm still stood at the end of the period." if data.alarm_standing else ""
        found.append(
            warning(
                "tamper-warning",
                f"{len(data.tamper)} tamper alarms were raised in the period.{standing}",
            )
        )
    return found


def _cosignature_problem(data: ReportData, now: datetime) -> str | None:
    """None when a witness cosigned the log recently enough before the period's end."""
    newest = data.newest_cosignature
    if newest is None:
        return (
            "No witness cosignature in the audit log up to the end of the period: no party "
            "outside the gateway has confirmed that the log was not rewritten."
        )
    age = min(data.until, now) - newest
    if age > data.cosignature_max_age:
        return (
            f"The newest witness cosignature ({format_timestamp(newest)}) is older than "
            f"{data.cosignature_max_age.total_seconds() / 3600:g} hours at the end of the "
            "period: the log since then is "
            "confirmed by no party outside the gateway."
        )
    return None


def _notices(data: ReportData) -> list[str]:
    found = []
    if data.content_stored:
        found.append(
            notice(
                "content-notice",
                f"Content storage was ON in the period: the text of {data.stored_requests} of "
                f"{data.total_requests} requests was stored, encrypted (see Content storage).",
            )
        )
    if data.declared_changes:
        found.append(
            notice(
                "declared-changed",
                f"The declared record changed {len(data.declared_changes)} times in the period; "
                "Part I shows the version in force at its end.",
            )
        )
    return found


def _period(data: ReportData) -> str:
    return (
        "<h3 id='period'>II.1 Period covered</h3>"
        + facts(
            [
                ("From (inclusive)", format_timestamp(data.since)),
                ("To (exclusive)", format_timestamp(data.until)),
                ("Audit events", _seq_range(data)),
            ]
        )
        + source("created_at and seq of the audit events")
    )


def _content_storage(data: ReportData) -> str:
    at_start = {None: "no start before the period", True: "on", False: "off"}
    key_choices = [
        [k.key_id, k.name, "stored" if k.store_content else "not stored"]
        for k in data.keys.values()
        if k.store_content is not None and not k.revoked_at
    ]
    return "".join(
        [
            "<h3 id='content-storage-section'>II.2 Content storage</h3><div class='cards'>",
            card(
                "Content storage",
                "content-storage",
                "ON" if data.content_stored else "OFF",
                "startup events (config.store_content), key events (store_content), "
                "request events (content field)",
            ),
            card(
                "Requests whose content was stored",
                "stored-requests",
                f"{data.stored_requests} of {data.total_requests}",
                "request events that carry a content field",
            ),
            card(
                "Server setting before the period",
                "storage-at-start",
                at_start[data.storage_at_start],
                "the newest startup event before the period",
            ),
            "</div>",
            table(
                ["started", "seq", "instance", "store_content", "retention (days)"],
                [
                    [s["at"], s["seq"], s["instance_id"], s["store_content"], s["retention_days"]]
                    for s in data.startups
                ],
                "No start in the period.",
                "startups",
            ),
            source("startup events in the period (the configuration snapshot)"),
            table(
                ["key id", "holder", "own choice"],
                key_choices,
                "No active key overrides the server's setting.",
            ),
            source("key events up to the end of the period (store_content)"),
        ]
    )


def _requests(data: ReportData) -> str:
    slots = sorted(set(data.requests) | set(data.fallbacks) | set(data.draft_tokens))
    slots = slots or [data.since]
    acceptance = {
        slot: data.accepted_tokens[slot] / data.draft_tokens[slot]
        for slot in slots
        if data.draft_tokens[slot]
    }
    rate = data.acceptance_rate
    return "".join(
        [
            "<h3 id='requests-section'>II.3 Requests</h3><div class='cards'>",
            card("Requests", "requests", data.total_requests, "request events"),
            card("Completions", "completions", sum(data.outcomes.values()), "completion events"),
            card(
                "Acceptance rate",
                "acceptance",
                "n/a" if rate is None else f"{rate:.1%}",
                "completion events: accepted / drafted tokens",
            ),
            card("Fallback events", "fallbacks", sum(data.fallbacks.values()), "fallback events"),
            "</div>",
            svg_chart("Requests", {s: float(data.requests[s]) for s in slots}, "requests"),
            table(
                ["key", "requests"],
                [[name, count] for name, count in data.requests_by_key.most_common()],
                "No requests in the period.",
            ),
            table(
                ["outcome", "completions"],
                [[name, count] for name, count in data.outcomes.most_common()],
                "No completions in the period.",
            ),
            source("request events (key name) and completion events (outcome)"),
            svg_chart(
                "Acceptance rate", acceptance or {data.since: 0.0}, "accepted / drafted", "line"
            ),
            svg_chart("Fallback events", {s: float(data.fallbacks[s]) for s in slots}, "events"),
            table(
                ["at", "method", "action", "reason"],
                [
                    [e["at"], e.get("method"), e.get("action"), e.get("reason")]
                    for e in data.fallback_events
                ],
                "No fallback events in the period.",
            ),
            "<p>Acceptance drift: a workload's speculation accepting less than tuning measured "
            "(or than the floor), as each drift started.</p>",
            table(
                ["at", "model", "method", "workload", "rolling", "expected", "floor", "reason"],
                [
                    [
                        e["at"],
                        e.get("model"),
                        e.get("method"),
                        e.get("workload"),
                        e.get("rolling_acceptance"),
                        e.get("expected_acceptance"),
                        e.get("floor"),
                        e.get("reason"),
                    ]
                    for e in data.drift_events
                ],
                "No acceptance drift in the period.",
                "acceptance-drift",
            ),
            source("acceptance_drift events in the period"),
        ]
    )


def _subject_rights(data: ReportData) -> str:
    keys_destroyed = sum(len(e.get("key_refs") or []) for e in data.erasure_requests)
    return "".join(
        [
            "<h3 id='subject-rights'>II.4 Erasure, retention and legal holds</h3>",
            "<div class='cards'>",
            card(
                "Erasure requests (data subjects)",
                "erasures",
                len(data.erasure_requests),
                "erasure events with cause subject_request: one row each below",
            ),
            card(
                "Data keys expired (retention)",
                "retention-expiries",
                len(data.retention_expiries),
                "erasure events with cause retention: one row each below",
            ),
            card("Legal hold actions", "holds", len(data.holds), "legal_hold events"),
            "</div>",
            "<p>Erasure requests, each erasing or refusing (legal hold) one data subject; "
            f"{keys_destroyed} data keys destroyed in all.</p>",
            table(
                ["at", "seq", "by", "subject (keyed reference)", "outcome", "keys destroyed"],
                [
                    [
                        e["at"],
                        e["seq"],
                        e["actor"],
                        e.get("subject_ref"),
                        e.get("outcome"),
                        len(e.get("key_refs") or []),
                    ]
                    for e in data.erasure_requests
                ],
                "No erasure requests in the period.",
                "erasure-requests",
            ),
            "<p>Retention: one data key expired per row.</p>",
            table(
                ["at", "seq", "key", "key created", "retention (days)"],
                [
                    [
                        e["at"],
                        e["seq"],
                        ", ".join(e.get("key_refs") or []),
                        e.get("key_created_at"),
                        e.get("retention_days"),
                    ]
                    for e in data.retention_expiries
                ],
                "No content keys expired in the period.",
                "retention-expiries-table",
            ),
            table(
                ["at", "by", "subject (keyed reference)", "action"],
                [[e["at"], e["actor"], e.get("subject_ref"), e.get("action")] for e in data.holds],
                "No legal holds placed or released in the period.",
            ),
            source("erasure and legal_hold events in the period"),
        ]
    )


def _disclosures(data: ReportData) -> str:
    return "".join(
        [
            "<h3 id='exports'>II.5 Exports of the audit log</h3><div class='cards'>",
            card("Exports", "export-count", len(data.exports), "export events: one row each"),
            "</div>",
            table(
                ["at", "by (key id)", "since", "until", "format", "events"],
                [
                    [
                        e["at"],
                        e["actor"],
                        e.get("since"),
                        e.get("until"),
                        e.get("format"),
                        f"{e.get('first_seq')} to {e.get('last_seq')}",
                    ]
                    for e in data.exports
                ],
                "No exports in the period.",
            ),
            source("export events in the period"),
        ]
    )


def _keys(data: ReportData) -> str:
    return "".join(
        [
            "<h3 id='keys'>II.6 Keys and roles</h3>",
            "<p>Keys as their key events describe them at the end of the period.</p>",
            table(
                ["key id", "holder", "role", "created", "revoked"],
                [
                    [k.key_id, k.name, k.role, k.created_at, k.revoked_at]
                    for k in data.keys.values()
                ],
                "No keys.",
                "key-state",
            ),
            source("all key events before the end of the period"),
            "<p>Key and role changes in the period.</p>",
            table(
                ["at", "seq", "by", "action", "key id", "holder", "role", "store_content"],
                [
                    [
                        c["at"],
                        c["seq"],
                        c["actor"],
                        c.get("action"),
                        c.get("key_id"),
                        c.get("name"),
                        c.get("role"),
                        c.get("store_content", ""),
                    ]
                    for c in data.key_changes
                ],
                "No key changes in the period.",
                "key-changes",
            ),
            source("key events in the period"),
        ]
    )


def _models(data: ReportData) -> str:
    return (
        "<h3 id='models'>II.7 Models and artefacts in service</h3>"
        + table(
            ["model", "target version", "artefacts", "first seen", "requests"],
            [[*version, first, count] for version, (first, count) in data.versions.items()],
            "No model served or started in the period.",
        )
        + source("startup and request events (model, target_version, artefacts)")
    )


def _replays(data: ReportData) -> str:
    return (
        "<h3 id='replays'>II.8 Replays</h3>"
        + table(
            ["at", "by", "request event", "replayed", "match"],
            [
                [e["at"], e["actor"], e.get("request_event_id"), e.get("replayed"), e.get("match")]
                for e in data.replays
            ],
            "No replays in the period.",
        )
        + source("replay events in the period")
        + "<p id='tuning'>Tuning runs (<code>specgate tune measure</code>, <code>tune "
        "train</code>): stored content read to measure speculation offline or to retrain "
        "speculation heads on; erased and held subjects left out.</p>"
        + table(
            ["at", "by", "run", "source", "requests read", "subjects read", "left out"],
            [
                [
                    e["at"],
                    e["actor"],
                    e.get("run"),
                    e.get("source"),
                    len(e.get("request_event_ids") or e.get("request_ids") or []),
                    len(e.get("subject_refs") or []),
                    ", ".join(f"{k}: {v}" for k, v in sorted((e.get("skipped") or {}).items())),
                ]
                for e in data.tuning_runs
            ],
            "No tuning runs in the period.",
            "tuning-runs",
        )
        + source("tune_measure and tune_train events in the period")
    )


def _verification_status(data: ReportData) -> str:
    verification = data.verification
    if verification is None:
        return f"<span class='bad'>not verified</span>: {esc(data.verification_note)}"
    if verification.ok:
        return f"<span class='ok'>verified</span>: {esc(verification.reason)}"
    return (
        f"<span class='bad'>FAILED</span> at event {verification.first_bad_seq}: "
        f"{esc(verification.reason)}"
    )


def _integrity(data: ReportData) -> str:
    newest = data.newest_cosignature
    return "".join(
        [
            "<h3 id='integrity'>II.9 Integrity of the log</h3>",
            f"<p id='verification'>{_verification_status(data)}</p>",
            source("specgate compliance report: hashes, MACs and checkpoints of the period"),
            "<div class='cards'>",
            card(
                "Signed checkpoints",
                "checkpoints",
                data.checkpoints,
                "checkpoint events"
                + (
                    f" (latest tree size {data.latest_checkpoint_size})"
                    if data.latest_checkpoint_size is not None
                    else ""
                ),
            ),
            card(
                "Witness cosignatures",
                "cosignatures",
                len(data.cosignatures),
                "cosignature events in the period",
            ),
            card(
                "Newest cosignature",
                "newest-cosignature",
                format_timestamp(newest) if newest else "none",
                "the newest cosignature event before the period's end",
            ),
            card("Tamper alarms", "tamper", len(data.tamper), "tamper_detected events"),
            card(
                "Alarms cleared",
                "alarms-cleared",
                len(data.alarms_cleared),
                "alarm_cleared events",
            ),
            "</div>",
            table(
                ["at", "first bad seq", "reason"],
                [[e["at"], e.get("first_bad_seq"), e.get("reason")] for e in data.tamper],
                "No tamper alarm in the period.",
            ),
            table(
                ["at", "by", "alarm", "evidence"],
                [
                    [e["at"], e["actor"], (e.get("alarm") or {}).get("reason"), e.get("evidence")]
                    for e in data.alarms_cleared
                ],
                "No alarm cleared in the period.",
            ),
        ]
    )
