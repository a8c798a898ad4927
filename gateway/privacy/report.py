"""The compliance report (``specgate compliance report``): one self-contained HTML page, a
record of processing activities (revDSG Art. 12, GDPR Art. 30) an auditor can file.

Part I is the operator's declared record, as the newest ``processing_record`` event before the
period's end holds it (``gateway.privacy.processing_record``); without one the page opens with
a warning. Part II is the evidence, read from the audit log alone, never from tables the
database owner can edit: whether content was stored, requests and outcomes, erasures,
retention, legal holds and exports, key and role changes, models in service, acceptance
drift, replays, the chain verification, witness cosignatures and tamper alarms; each figure
names the events it counts. Charts are inline SVG drawn with matplotlib: no script, nothing
loaded from elsewhere.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from gateway.audit.canonical import format_timestamp
from gateway.audit.schema import audit_events
from gateway.audit.verify import VerifyReport
from gateway.privacy.processing_record import DeclaredVersion, declared_versions
from gateway.recording import recorded_artefacts

_KINDS = (
    "request",
    "completion",
    "fallback",
    "startup",
    "erasure",
    "legal_hold",
    "export",
    "checkpoint",
    "cosignature",
    "tamper_detected",
    "alarm_cleared",
    "replay",
    "tune_measure",
    "tune_train",
    "acceptance_drift",
)
COSIGNATURE_MAX_AGE = timedelta(hours=24)


@dataclass
class KeyState:
    """A key as its ``key`` events describe it (not as the editable ``api_keys`` row says)."""

    key_id: str
    name: str
    role: str
    created_at: str = ""
    revoked_at: str = ""
    store_content: bool | None = None


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
    stored_requests: int = 0
    # (model, target version, artefacts) -> [first seen, requests served]
    versions: dict[tuple[Any, ...], list[Any]] = field(default_factory=dict)
    startups: list[dict[str, Any]] = field(default_factory=list)
    # The store_content setting of the newest start before the period (None: no start before).
    storage_at_start: bool | None = None
    fallback_events: list[dict[str, Any]] = field(default_factory=list)
    # Drifts of a workload's acceptance away from what tuning measured, as they started.
    drift_events: list[dict[str, Any]] = field(default_factory=list)
    erasure_requests: list[dict[str, Any]] = field(default_factory=list)
    retention_expiries: list[dict[str, Any]] = field(default_factory=list)
    holds: list[dict[str, Any]] = field(default_factory=list)
    exports: list[dict[str, Any]] = field(default_factory=list)
    replays: list[dict[str, Any]] = field(default_factory=list)
    # `specgate tune measure` and `tune train` runs: each names the requests and subjects whose
    # content it read.
    tuning_runs: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: int = 0
    latest_checkpoint_size: int | None = None
    cosignatures: list[dict[str, Any]] = field(default_factory=list)
    newest_cosignature: datetime | None = None
    cosignature_max_age: timedelta = COSIGNATURE_MAX_AGE
    tamper: list[dict[str, Any]] = field(default_factory=list)
    alarms_cleared: list[dict[str, Any]] = field(default_factory=list)
    alarm_standing: bool = False
    keys: dict[str, KeyState] = field(default_factory=dict)
    key_changes: list[dict[str, Any]] = field(default_factory=list)
    first_seq: int | None = None
    last_seq: int | None = None
    declared: DeclaredVersion | None = None
    declared_changes: list[DeclaredVersion] = field(default_factory=list)
    verification: VerifyReport | None = None
    verification_note: str = ""

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def acceptance_rate(self) -> float | None:
        drafted = sum(self.draft_tokens.values())
        return sum(self.accepted_tokens.values()) / drafted if drafted else None

    @property
    def content_stored(self) -> bool:
        """Whether content could have been or was stored in the period: by the server's
        setting, a key's choice, or a request's."""
        return bool(
            self.storage_at_start
            or any(s["store_content"] for s in self.startups)
            or any(k.store_content for k in self.keys.values())
            or self.stored_requests
        )


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _bucket_of(moment: datetime, since: datetime, bucket: timedelta) -> datetime:
    return since + bucket * ((moment - since) // bucket)


def collect(
    db: sa.Engine,
    since: datetime,
    until: datetime,
    cosignature_max_age: timedelta = COSIGNATURE_MAX_AGE,
) -> ReportData:
    """The figures of the events created in [since, until), and what the log says was in
    force then: the declared record, the keys, the content setting, the newest cosignature
    and whether a tamper alarm stood."""
    since, until = _utc(since), _utc(until)
    bucket = timedelta(hours=1) if until - since <= timedelta(days=2) else timedelta(days=1)
    data = ReportData(since, until, bucket, cosignature_max_age=cosignature_max_age)
    with db.connect() as connection:
        _collect_period(connection, data)
        _collect_keys(connection, data)
        data.storage_at_start = _storage_before(connection, since)
        data.newest_cosignature = _newest_cosignature(connection, until)
        data.alarm_standing = _alarm_standing(connection, until)
    versions = declared_versions(db, until)
    data.declared = versions[-1] if versions else None
    data.declared_changes = [v for v in versions if v.created_at >= since]
    return data


def _before(until: datetime, *kinds: str) -> sa.Select[Any]:
    """The newest event of ``kinds`` created before ``until``."""
    events = audit_events.c
    return (
        sa.select(events.kind, events.created_at, events.payload)
        .where(events.kind.in_(kinds), events.created_at < until)
        .order_by(events.seq.desc())
        .limit(1)
    )


def _collect_period(connection: sa.Connection, data: ReportData) -> None:
    events = audit_events.c
    in_period = sa.and_(events.created_at >= data.since, events.created_at < data.until)
    data.first_seq, data.last_seq = connection.execute(
        sa.select(sa.func.min(events.seq), sa.func.max(events.seq)).where(in_period)
    ).one()
    query = (
        sa.select(events.seq, events.created_at, events.kind, events.actor, events.payload)
        .where(in_period, events.kind.in_(_KINDS))
        .order_by(events.seq)
    )
    for seq, created_at, kind, actor, payload in connection.execute(
        query.execution_options(yield_per=2000)
    ):
        _count(data, _utc(created_at), kind, actor, {**payload, "seq": seq})


def _collect_keys(connection: sa.Connection, data: ReportData) -> None:
    """Every key's state at the period's end from all its ``key`` events, and the changes
    made in the period."""
    events = audit_events.c
    query = (
        sa.select(events.seq, events.created_at, events.actor, events.payload)
        .where(events.kind == "key", events.created_at < data.until)
        .order_by(events.seq)
    )
    for seq, created_at, actor, payload in connection.execute(query):
        moment = _utc(created_at)
        _apply_key_event(data.keys, format_timestamp(moment), payload)
        if moment >= data.since:
            data.key_changes.append(
                {"seq": seq, "at": format_timestamp(moment), "actor": actor, **payload}
            )


def _apply_key_event(keys: dict[str, KeyState], when: str, payload: dict[str, Any]) -> None:
    key_id = str(payload.get("key_id"))
    state = keys.setdefault(
        key_id, KeyState(key_id, str(payload.get("name")), str(payload.get("role")))
    )
    action = payload.get("action")
    if action == "created":
        state.created_at = when
    elif action == "revoked":
        state.revoked_at = when
    if action in ("created", "updated") or "store_content" in payload:
        state.store_content = payload.get("store_content")


def _storage_before(connection: sa.Connection, since: datetime) -> bool | None:
    row = connection.execute(_before(since, "startup")).first()
    return None if row is None else bool(row.payload.get("config", {}).get("store_content"))


def _newest_cosignature(connection: sa.Connection, until: datetime) -> datetime | None:
    row = connection.execute(_before(until, "cosignature")).first()
    if row is None:
        return None
    cosigned_at = row.payload.get("cosigned_at")
    if isinstance(cosigned_at, int):
        return datetime.fromtimestamp(cosigned_at, UTC)
    return _utc(row.created_at)


def _alarm_standing(connection: sa.Connection, until: datetime) -> bool:
    row = connection.execute(_before(until, "tamper_detected", "alarm_cleared")).first()
    return row is not None and row.kind == "tamper_detected"


def _count(
    data: ReportData, moment: datetime, kind: str, actor: str | None, payload: dict[str, Any]
) -> None:
    slot = _bucket_of(moment, data.since, data.bucket)
    when = format_timestamp(moment)
    if kind in ("request", "startup"):
        _count_version(data, when, kind, payload)
    if kind == "request":
        data.requests[slot] += 1
        data.requests_by_key[str(payload.get("key_name"))] += 1
        data.stored_requests += "content" in payload
    elif kind == "startup":
        config = payload.get("config") or {}
        data.startups.append(
            {
                "at": when,
                "seq": payload.get("seq"),
                "instance_id": payload.get("instance_id"),
                "store_content": bool(config.get("store_content")),
                "retention_days": config.get("retention_days"),
            }
        )
    elif kind == "completion":
        data.outcomes[str(payload.get("outcome"))] += 1
        speculative = payload.get("speculative") or {}
        data.draft_tokens[slot] += int(speculative.get("num_draft_tokens") or 0)
        data.accepted_tokens[slot] += int(speculative.get("num_accepted_tokens") or 0)
    elif kind == "fallback":
        data.fallbacks[slot] += 1
        data.fallback_events.append({"at": when, **payload})
    elif kind == "checkpoint":
        data.checkpoints += 1
        data.latest_checkpoint_size = payload.get("size", data.latest_checkpoint_size)
    else:
        row = {"at": when, "actor": actor, **payload}
        if kind in ("tune_measure", "tune_train"):
            row["run"] = kind  # which command read the content
        _listed(data, kind, payload).append(row)


def _listed(data: ReportData, kind: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The table of the report that an event of ``kind`` is one row of."""
    if kind == "erasure":
        retention = payload.get("cause") == "retention"
        return data.retention_expiries if retention else data.erasure_requests
    lists: dict[str, list[dict[str, Any]]] = {
        "legal_hold": data.holds,
        "export": data.exports,
        "replay": data.replays,
        "tune_measure": data.tuning_runs,
        "tune_train": data.tuning_runs,
        "acceptance_drift": data.drift_events,
        "cosignature": data.cosignatures,
        "tamper_detected": data.tamper,
        "alarm_cleared": data.alarms_cleared,
    }
    return lists[kind]


def _count_version(data: ReportData, when: str, kind: str, payload: dict[str, Any]) -> None:
    artefacts = ", ".join(
        f"{a.get('kind')} {a.get('name')} {a.get('version')}" for a in recorded_artefacts(payload)
    )
    version = (payload.get("model"), payload.get("target_version"), artefacts)
    seen = data.versions.setdefault(version, [when, 0])
    seen[1] += kind == "request"
