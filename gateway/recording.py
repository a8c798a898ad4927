"""The gateway's audit events: what each one records, and appending them off the event loop.

Prompt and completion text are recorded only as SHA-256 unless ``store_content`` is set
(privacy by default); the hashes still let an auditor prove which text a record covers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import structlog

from engine.types import FallbackEvent, GenerationStats, SamplingParams, SpeculativeChoice
from gateway.audit.log import AppendedEvent, AuditLog, AuditUnavailableError
from gateway.backends.base import BackendCard
from gateway.keys import Principal
from gateway.offload import Offload
from gateway.settings import Settings
from gateway.spool import EventSpool

log = structlog.get_logger(__name__)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_token_ids(token_ids: Sequence[int]) -> str:
    """Hash of a prompt given as token ids: the ids as decimal, comma-separated, in UTF-8."""
    return sha256_text(",".join(str(token) for token in token_ids))


async def append_event(
    offload: Offload, audit: AuditLog, kind: str, actor: str | None, payload: dict[str, Any]
) -> AppendedEvent:
    """Append and commit one event on the database pool; raises AuditUnavailableError when it
    fails or does not finish within the offload's bound."""
    return await offload.db(audit.append, kind, actor, payload)


async def append_durably(
    offload: Offload,
    audit: AuditLog,
    spool: EventSpool,
    kind: str,
    actor: str | None,
    payload: dict[str, Any],
) -> bool:
    """Commit an event that must not be lost: directly when the store answers in time, else
    into the durable spool (committed later, once). True when committed directly. Raises
    AuditUnavailableError only when the spool cannot be written either."""
    attempted_at = datetime.now(UTC)
    attempt = offload.submit_db(audit.append, kind, actor, payload)
    try:
        await offload.wait_db(attempt, f"{kind} append")
        return True
    except AuditUnavailableError as error:
        log.warning("event_spooled", kind=kind, error=str(error))
    try:
        await offload.io(spool.keep, kind, actor, payload, attempt, attempted_at)
    except OSError as error:
        raise AuditUnavailableError(f"audit spool unwritable: {error}") from error
    return False


def models_in_use(card: BackendCard) -> dict[str, Any]:
    return {
        "model": card.model_name,
        "target_version": card.target_version,
        "draft": card.draft_name,
        "draft_version": card.draft_version,
        "artefacts": [dict(a) for a in card.artefacts],
    }


def startup_payload(settings: Settings, card: BackendCard) -> dict[str, Any]:
    return {
        "config": settings.public_snapshot(),
        **models_in_use(card),
        "available_methods": list(card.available_methods),
        "speculative_config": card.speculative_config,
        "max_context": card.max_context,
    }


def request_payload(
    *,
    card: BackendCard,
    principal: Principal,
    route: str,
    request_id: str,
    prompt_sha256: str,
    prompt_tokens: int,
    sampling: SamplingParams,
    n: int,
    speculative: SpeculativeChoice,
    stream: bool,
    user: str | None,
    content: Any | None,
) -> dict[str, Any]:
    """The `request` event, committed before generation starts (fail closed)."""
    payload: dict[str, Any] = {
        "request_id": request_id,
        "route": route,
        "key_id": principal.key_id,
        "key_name": principal.name,
        "user": user,
        **models_in_use(card),
        "speculative": {
            "requested_method": speculative.method,
            "requested_num_speculative_tokens": speculative.num_speculative_tokens,
            "default_method": card.default_method,
            "default_num_speculative_tokens": card.default_num_speculative_tokens,
        },
        "sampling": {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "seed": sampling.seed,
            "stop": list(sampling.stop),
            "n": n,
        },
        "stream": stream,
        "prompt_sha256": prompt_sha256,
        "prompt_tokens": prompt_tokens,
    }
    if content is not None:
        payload["prompt"] = content
    return payload


def combined_stats(all_stats: Sequence[GenerationStats]) -> GenerationStats | None:
    """One figure for all choices of a request: counts add up, fallback is any choice's."""
    if not all_stats:
        return None
    total = GenerationStats(method=all_stats[0].method)
    for stats in all_stats:
        total.num_prompt_tokens = stats.num_prompt_tokens
        total.num_output_tokens += stats.num_output_tokens
        total.num_drafts += stats.num_drafts
        total.num_draft_tokens += stats.num_draft_tokens
        total.num_accepted_tokens += stats.num_accepted_tokens
        total.num_target_passes += stats.num_target_passes
        total.fallback_active = total.fallback_active or stats.fallback_active
        total.total_time_s = max(total.total_time_s, stats.total_time_s)
    total.time_to_first_token_s = min(stats.time_to_first_token_s for stats in all_stats)
    return total


def completion_payload(
    *,
    request_event_id: str,
    outcome: str,
    error: str | None,
    texts: Sequence[str],
    finish_reasons: Sequence[str | None],
    prompt_tokens: int,
    completion_tokens: int,
    stats: GenerationStats | None,
    latency_s: float,
    store_content: bool,
) -> dict[str, Any]:
    """The `completion` event, referencing its `request` event."""
    payload: dict[str, Any] = {
        "request_event_id": request_event_id,
        "outcome": outcome,
        "error": error,
        "finish_reasons": list(finish_reasons),
        "completion_sha256": [sha256_text(text) for text in texts],
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "latency_s": latency_s,
        "speculative": None,
        "fallback_active": None,
    }
    if stats is not None:
        payload["speculative"] = {
            "method": stats.method,
            "num_drafts": stats.num_drafts,
            "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": stats.acceptance_rate,
            "mean_acceptance_length": stats.mean_acceptance_length,
            "num_target_passes": stats.num_target_passes,
        }
        payload["fallback_active"] = stats.fallback_active
        payload["time_to_first_token_s"] = stats.time_to_first_token_s
    if store_content:
        payload["completions"] = list(texts)
    return payload


def fallback_recorder(spool: EventSpool) -> Callable[[FallbackEvent], None]:
    """The backend's ``on_fallback`` callback: a `fallback` event per switch.

    It runs on the backend's worker thread, so it only writes the event to the durable spool
    (local disk, never the database); the spool's writer commits it, retrying until the store
    takes it. A spool that cannot be written is logged, never raised into the engine.
    """

    def record(event: FallbackEvent) -> None:
        try:
            spool.enqueue("fallback", None, event.as_dict())
        except Exception:
            log.exception("fallback_event_not_recorded", method=event.method, action=event.action)

    return record
