"""Usage per key, team, model and speculation method, in hourly or daily buckets, for
chargeback: read from the audit log itself, so that it counts exactly the requests the log
records and needs no write of its own on the request path.

A request counts in the bucket of its `request` event; its tokens, speculation figures and
outcome come from its `completion` event (a request still in flight counts with no tokens
yet). ``errors``: requests whose completion records another outcome than ``ok`` (an engine
error, a disconnect, a shutdown). The team is the one the key belonged to when the request was
admitted (recorded in the `request` event).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Literal

import sqlalchemy as sa

from gateway.audit.schema import audit_events

Bucket = Literal["hour", "day"]
GROUP = ("bucket", "key_id", "key_name", "team", "model", "method")
FIGURES = (
    "requests",
    "errors",
    "prompt_tokens",
    "completion_tokens",
    "draft_tokens",
    "accepted_tokens",
)
COLUMNS = GROUP + FIGURES


def _bucket(moment: datetime, bucket: Bucket) -> str:
    moment = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    start = moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    if bucket == "day":
        start = start.replace(hour=0)
    return start.isoformat()


def _events(connection: sa.Connection, kind: str, since: datetime, until: datetime | None) -> Any:
    c = audit_events.c
    query = sa.select(c.event_id, c.created_at, c.payload).where(
        c.kind == kind, c.created_at >= since
    )
    if until is not None:
        query = query.where(c.created_at < until)
    return connection.execute(query.order_by(c.seq))


def usage(
    db: sa.Engine,
    since: datetime,
    until: datetime | None = None,
    bucket: Bucket = "hour",
    key_id: str | None = None,
    team: str | None = None,
) -> list[dict[str, Any]]:
    """The usage rows of the requests made in [since, until), sorted by their group."""
    with db.connect() as connection:
        requests = {
            row.event_id: row
            for row in _events(connection, "request", since, until)
            if (key_id is None or row.payload.get("key_id") == key_id)
            and (team is None or row.payload.get("team") == team)
        }
        outcomes = {
            row.payload.get("request_event_id"): row.payload
            for row in _events(connection, "completion", since, None)
        }
    totals: dict[tuple[str, ...], dict[str, Any]] = {}
    for event_id, row in requests.items():
        request = row.payload
        completion = outcomes.get(event_id)
        speculative = (completion or {}).get("speculative") or {}
        method = (
            speculative.get("method")
            or (request.get("speculative") or {}).get("requested_method")
            or "default"
        )
        group = (
            _bucket(row.created_at, bucket),
            request.get("key_id", ""),
            request.get("key_name", ""),
            request.get("team") or "",
            request.get("model", ""),
            str(method),
        )
        total = totals.setdefault(
            group, {**dict(zip(GROUP, group, strict=True)), **dict.fromkeys(FIGURES, 0)}
        )
        total["requests"] += 1
        if completion is None:
            continue
        total["errors"] += completion.get("outcome") != "ok"
        total["prompt_tokens"] += completion.get("prompt_tokens") or 0
        total["completion_tokens"] += completion.get("completion_tokens") or 0
        total["draft_tokens"] += speculative.get("num_draft_tokens") or 0
        total["accepted_tokens"] += speculative.get("num_accepted_tokens") or 0
    return [totals[group] for group in sorted(totals)]


def as_csv(rows: Iterable[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
