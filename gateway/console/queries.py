"""What the console reads from the audit store: read-only queries, each run off the event
loop by the routes. Every figure comes from the append-only log (or the key table for the key
list), never from state the page keeps."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError

from gateway.audit.log import AuditUnavailableError, record_from_row
from gateway.audit.records import EventRecord
from gateway.audit.schema import api_keys, audit_events
from gateway.keys import Principal

PAGE_SIZE = 50
# How many of the newest completion events the models page summarises.
PERFORMANCE_WINDOW = 500
OPERATOR_KINDS = (
    "fallback", "acceptance_drift", "tamper_detected", "alarm_cleared", "backend_replica",
)


@dataclass(frozen=True)
class EventQuery:
    since: datetime | None = None
    until: datetime | None = None
    kind: str | None = None
    actor: str | None = None  # a key id
    model: str | None = None
    before: int | None = None  # page: events with a smaller seq


def _read(db: sa.Engine, work: Any) -> Any:
    try:
        with db.connect() as connection:
            return work(connection)
    except SQLAlchemyError as exc:
        raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc


def active_key(db: sa.Engine, key_id: str) -> Principal | None:
    """The active key with this id (a session's key is looked up on every page)."""
    c = api_keys.c
    query = sa.select(c.key_id, c.name, c.role, c.store_content, c.team_id).where(
        c.key_id == key_id, c.revoked_at.is_(None)
    )
    row = _read(db, lambda connection: connection.execute(query).first())
    if row is None:
        return None
    return Principal(row.key_id, row.name, row.role, row.store_content, row.team_id)


def key_id_for(db: sa.Engine, id_or_name: str) -> str:
    """The id of the key named ``id_or_name`` (active or not), else the text as given."""
    c = api_keys.c
    query = sa.select(c.key_id).where(sa.or_(c.key_id == id_or_name, c.name == id_or_name))
    found = _read(db, lambda connection: connection.execute(query).scalars().first())
    return str(found) if found else id_or_name


def search_events(db: sa.Engine, query: EventQuery) -> tuple[list[EventRecord], int | None]:
    """One page of events, newest first, and the ``before`` of the next page (None: last)."""
    c = audit_events.c
    select = sa.select(audit_events).order_by(c.seq.desc()).limit(PAGE_SIZE + 1)
    if query.since is not None:
        select = select.where(c.created_at >= query.since)
    if query.until is not None:
        select = select.where(c.created_at < query.until)
    if query.kind:
        select = select.where(c.kind == query.kind)
    if query.actor is not None:
        select = select.where(c.actor == query.actor)
    if query.model:
        select = select.where(c.payload["model"].as_string() == query.model)
    if query.before is not None:
        select = select.where(c.seq < query.before)
    rows = _read(db, lambda connection: connection.execute(select).all())
    events = [record_from_row(row) for row in rows[:PAGE_SIZE]]
    more = len(rows) > PAGE_SIZE
    return events, (events[-1].seq if more and events else None)


def event_kinds(db: sa.Engine) -> list[str]:
    query = sa.select(audit_events.c.kind).distinct().order_by(audit_events.c.kind)
    return list(_read(db, lambda connection: connection.execute(query).scalars().all()))


def recent_events(db: sa.Engine, kinds: tuple[str, ...], limit: int = 20) -> list[EventRecord]:
    c = audit_events.c
    query = sa.select(audit_events).where(c.kind.in_(kinds)).order_by(c.seq.desc()).limit(limit)
    rows = _read(db, lambda connection: connection.execute(query).all())
    return [record_from_row(row) for row in rows]


def model_performance(db: sa.Engine, window: int = PERFORMANCE_WINDOW) -> list[dict[str, Any]]:
    """Per model and speculation method, over the newest ``window`` completions: how many,
    decode speed (completion tokens over latency), acceptance rate and mean accepted length,
    and how many ran with the method switched off (fallback)."""
    c = audit_events.c
    completions = (
        sa.select(c.payload).where(c.kind == "completion").order_by(c.seq.desc()).limit(window)
    )

    def read(connection: sa.Connection) -> list[dict[str, Any]]:
        done = [row.payload for row in connection.execute(completions)]
        wanted = {p.get("request_event_id") for p in done if isinstance(p, dict)}
        models: dict[str, str] = {}
        if wanted:
            requests = sa.select(c.event_id, c.payload).where(
                c.kind == "request", c.event_id.in_([w for w in wanted if isinstance(w, str)])
            )
            for row in connection.execute(requests):
                models[row.event_id] = str(row.payload.get("model"))
        return [{**p, "_model": models.get(p.get("request_event_id"), "?")} for p in done]

    groups: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for payload in _read(db, read):
        speculative = payload.get("speculative") or {}
        method = str(speculative.get("method") or "none")
        group = groups[(payload["_model"], method)]
        group["requests"] += 1
        group["errors"] += payload.get("outcome") != "ok"
        tokens, latency = payload.get("completion_tokens") or 0, payload.get("latency_s") or 0
        if payload.get("outcome") == "ok" and tokens and latency:
            group["tokens"] += tokens
            group["seconds"] += latency
        group["drafts"] += speculative.get("num_drafts") or 0
        group["draft_tokens"] += speculative.get("num_draft_tokens") or 0
        group["accepted"] += speculative.get("num_accepted_tokens") or 0
        group["fallback"] += bool(payload.get("fallback_active"))
    summary = []
    for (model, method), g in sorted(groups.items()):
        summary.append(
            {
                "model": model,
                "method": method,
                "requests": int(g["requests"]),
                "errors": int(g["errors"]),
                "tokens_per_s": g["tokens"] / g["seconds"] if g["seconds"] else None,
                "acceptance_rate": g["accepted"] / g["draft_tokens"] if g["draft_tokens"] else None,
                "mean_accepted_length": 1 + g["accepted"] / g["drafts"] if g["drafts"] else None,
                "with_fallback": int(g["fallback"]),
            }
        )
    return summary
