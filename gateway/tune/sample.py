"""The requests a tuning run replays: recorded ones read back under the privacy settings, or
an operator's JSON-lines file of OpenAI request bodies.

Recorded requests are chosen newest first from the audit log's `request` events. A request is
left out, and counted under its reason, when its content was not stored, when its data key
is destroyed (its subject was erased, or retention expired it), or when its subject is under a
legal hold (content kept for a legal matter is not used for another purpose unless the
operator says so). What is left is named (event ids and subject references) in the run's
audit event (`tune_measure`, `tune_train`) *before* any of it is decrypted, so that a read
that is not recorded cannot happen (``audited_sample``); decrypted content stays in memory.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError

from engine.api.types import SamplingParams
from gateway.audit.canonical import format_timestamp
from gateway.audit.log import AppendedEvent, AuditLog, AuditUnavailableError, record_from_row
from gateway.audit.records import EventRecord
from gateway.audit.schema import audit_events
from gateway.privacy.commitments import ContentUnreadableError
from gateway.privacy.store import PrivacyStore

# Pages of `request` events read at a time while looking for the sample.
PAGE = 500
# The seed a request body without one is sampled with (plus its line number).
FILE_SEED = 1_000_003


@dataclass(frozen=True)
class TuneRequest:
    """One request to replay: where it came from (``source_id``: the `request` event id, or
    ``FILE:LINE``), the model it named, its workload cluster, and either its recorded prompt
    tokens or its request body (tokenized by the model that replays it)."""

    source_id: str
    model: str | None
    cluster: str
    sampling: dict[str, Any]
    prompt_ids: tuple[int, ...] | None = None
    body: dict[str, Any] | None = None
    subject_ref: str | None = None

    def sampling_params(self, max_tokens_cap: int) -> SamplingParams:
        """The recorded (or requested) sampling, its token budget capped at ``max_tokens_cap``."""
        s = self.sampling
        return SamplingParams(
            max_tokens=max(1, min(int(s.get("max_tokens") or max_tokens_cap), max_tokens_cap)),
            temperature=float(s.get("temperature", 1.0)),
            top_p=float(s.get("top_p", 1.0)),
            top_k=int(s.get("top_k") or 0),
            min_p=float(s.get("min_p", 0.0)),
            seed=s.get("seed"),
            stop=tuple(s.get("stop") or ()),
            stop_token_ids=tuple(s.get("stop_token_ids") or ()),
        )


@dataclass
class Candidates:
    """Recorded requests chosen for a run, before their content is read."""

    events: list[EventRecord] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)

    @property
    def event_ids(self) -> list[str]:
        return [event.event_id for event in self.events]

    @property
    def subject_refs(self) -> list[str]:
        return sorted({str(event.payload.get("subject_ref")) for event in self.events})


def cluster_of(payload: dict[str, Any]) -> str:
    """The workload cluster of a recorded request: its route and the key (application) that
    sent it."""
    route = str(payload.get("route") or "?")
    key = payload.get("key_name") or payload.get("key_id")
    return f"{route} {key}" if key else route


def choose_recorded(
    db: sa.Engine,
    privacy: PrivacyStore,
    *,
    limit: int,
    since: datetime | None = None,
    until: datetime | None = None,
    include_held: bool = False,
) -> Candidates:
    """Up to ``limit`` recorded requests, newest first, whose content can be read and may be
    used; the others counted by reason (``content_not_stored``, ``erased``, ``legal_hold``).
    Reads no content."""
    held = set() if include_held else set(privacy.holds())
    chosen = Candidates()
    live_keys: dict[str, bool] = {}
    before: int | None = None
    columns = audit_events.c
    while len(chosen.events) < limit:
        query = sa.select(audit_events).where(columns.kind == "request")
        if since is not None:
            query = query.where(columns.created_at >= since)
        if until is not None:
            query = query.where(columns.created_at < until)
        if before is not None:
            query = query.where(columns.seq < before)
        query = query.order_by(columns.seq.desc()).limit(PAGE)
        try:
            with db.connect() as connection:
                rows = connection.execute(query).all()
        except SQLAlchemyError as exc:
            raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
        if not rows:
            break
        for row in rows:
            event = record_from_row(row)
            reason = _unusable(event.payload, privacy, held, live_keys)
            if reason is not None:
                chosen.skipped[reason] += 1
            elif len(chosen.events) < limit:
                chosen.events.append(event)
        before = rows[-1].seq
    return chosen


def _unusable(
    payload: dict[str, Any], privacy: PrivacyStore, held: set[str], live_keys: dict[str, bool]
) -> str | None:
    content = payload.get("content")
    if not isinstance(content, dict):
        return "content_not_stored"
    if content.get("discarded"):
        return "erased"
    if payload.get("subject_ref") in held:
        return "legal_hold"
    key_ref = str((payload.get("commitment_key") or {}).get("key_ref"))
    if key_ref not in live_keys:
        live_keys[key_ref] = privacy.existing_key(key_ref) is not None
    return None if live_keys[key_ref] else "erased"


def read_recorded(
    privacy: PrivacyStore, candidates: Candidates
) -> tuple[list[TuneRequest], Counter[str]]:
    """Decrypt the chosen requests' prompts (in memory only). One whose key was destroyed
    since it was chosen is left out as ``erased``."""
    requests: list[TuneRequest] = []
    skipped: Counter[str] = Counter()
    for event in candidates.events:
        payload = event.payload
        try:
            content = privacy.read_content(payload["content"])
        except (ContentUnreadableError, KeyError):
            skipped["erased"] += 1
            continue
        sampling = dict(payload.get("sampling") or {})
        requests.append(
            TuneRequest(
                source_id=event.event_id,
                model=payload.get("model"),
                cluster=cluster_of(payload),
                sampling=sampling,
                prompt_ids=tuple(int(i) for i in content["prompt_token_ids"]),
                subject_ref=payload.get("subject_ref"),
            )
        )
    return requests, skipped


class RequestFileError(ValueError):
    """A line of the operator's file is not a chat or completion request body."""


def read_file(path: Path, limit: int) -> tuple[list[TuneRequest], str]:
    """Up to ``limit`` request bodies from a JSON-lines file, and the file's SHA-256. A
    ``messages`` body is a chat request (route /v1/chat/completions), a ``prompt`` body a
    completion; the cluster is the route and ``metadata.app`` where given. OpenAI's defaults
    apply (temperature 1), and a body without a seed gets one from its line, so that every
    method draws alike."""
    data = path.read_bytes()
    requests: list[TuneRequest] = []
    for number, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if len(requests) >= limit:
            break
        try:
            body = json.loads(line)
        except json.JSONDecodeError as error:
            raise RequestFileError(f"{path}:{number}: {error}") from None
        if not isinstance(body, dict) or not ({"messages", "prompt"} & body.keys()):
            raise RequestFileError(
                f"{path}:{number}: a request body needs 'messages' (chat) or 'prompt'"
            )
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        sampling = {
            "max_tokens": body.get("max_completion_tokens") or body.get("max_tokens"),
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "seed": body.get("seed", FILE_SEED + number),
            "stop": [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop"),
        }
        # OpenAI's ``metadata`` may name the application; the ``user`` is a subject, not one.
        metadata = body.get("metadata")
        app = metadata.get("app") if isinstance(metadata, dict) else None
        requests.append(
            TuneRequest(
                source_id=f"{path.name}:{number}",
                model=body.get("model"),
                cluster=f"{route} {app}" if app else route,
                sampling=sampling,
                body=body,
            )
        )
    return requests, hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Selection:
    """Which requests a run reads: up to ``limit`` from an operator's ``requests_file``, else
    the newest recorded ones in ``[since, until)`` (subjects under a legal hold only with
    ``include_held``)."""

    requests_file: Path | None
    limit: int
    since: datetime | None = None
    until: datetime | None = None
    include_held: bool = False


@dataclass
class Sample:
    """The requests read, the run's audit event, what it recorded of their source, and what
    was left out by reason."""

    requests: list[TuneRequest]
    event: AppendedEvent
    source: dict[str, Any]
    skipped: Counter[str]


def audited_sample(
    db: sa.Engine,
    audit: AuditLog,
    privacy: PrivacyStore,
    kind: str,
    actor: str,
    payload: dict[str, Any],
    selection: Selection,
) -> Sample:
    """The requests ``selection`` names, read after the run is appended as a ``kind`` audit
    event: ``payload`` (the run's options) plus the source, the request event ids (or file
    lines and the file's SHA-256), the subjects' keyed references whose content is read and
    what was left out and why. Raises ``AuditUnavailableError`` when the event cannot be
    appended (nothing is decrypted then), ``RequestFileError`` or ``OSError`` for a file that
    cannot be read."""
    skipped: Counter[str] = Counter()
    candidates: Candidates | None = None
    requests: list[TuneRequest] = []
    if selection.requests_file is not None:
        requests, sha256 = read_file(selection.requests_file, selection.limit)
        source: dict[str, Any] = {
            "source": "file", "file": str(selection.requests_file), "sha256": sha256,
        }
        recorded = {**source, "subject_refs": [], "request_ids": [r.source_id for r in requests]}
    else:
        candidates = choose_recorded(
            db, privacy, limit=selection.limit, since=selection.since, until=selection.until,
            include_held=selection.include_held,
        )
        skipped.update(candidates.skipped)
        source = {
            "source": "audit_log",
            "since": format_timestamp(selection.since) if selection.since else None,
            "until": format_timestamp(selection.until) if selection.until else None,
            "include_held": selection.include_held,
        }
        recorded = {
            **source,
            "request_event_ids": candidates.event_ids,
            "subject_refs": candidates.subject_refs,
            "skipped": dict(candidates.skipped),
        }
    # Before any content is decrypted: a read that is not recorded cannot happen.
    event = audit.append(kind, actor, {**payload, **recorded})
    if candidates is not None:
        requests, unreadable = read_recorded(privacy, candidates)
        skipped.update(unreadable)
    return Sample(requests, event, source, skipped)
