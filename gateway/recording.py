"""The gateway's audit events: what each one records, and appending them off the event loop.

Prompt and completion text never enter the chain. Events hold keyed commitments to them
(``gateway.privacy.commitments``) and, where content is stored, a commitment to its
ciphertext in the content table (``gateway.privacy.store``). Requests name their data
subject by keyed reference only.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import UTC, datetime
from typing import Any

import structlog

from engine.api.types import FallbackEvent, GenerationStats, SamplingParams, SpeculativeChoice
from gateway.audit.log import AppendedEvent, AuditLog, AuditUnavailableError
from gateway.audit.loop_append import LoopAppender
from gateway.backends.base import BackendCard
from gateway.keys import Principal
from gateway.offload import Offload
from gateway.privacy.store import SealedContent
from gateway.served_models import ServedModel, ServedModels
from gateway.settings import Settings
from gateway.spool import EventSpool

log = structlog.get_logger(__name__)


async def append_event(
    offload: Offload, audit: AuditLog, kind: str, actor: str | None, payload: dict[str, Any]
) -> AppendedEvent:
    """Append and commit one event on the database pool; raises AuditUnavailableError when it
    fails or does not finish within the offload's bound."""
    return await offload.db(audit.append, kind, actor, payload)


async def append_durably(
    offload: Offload,
    spool: EventSpool,
    appender: LoopAppender,
    kind: str,
    actor: str | None,
    payload: dict[str, Any],
    content: SealedContent | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> bool:
    """Commit an event that must not be lost: directly when the store answers in time, else
    into the durable spool (committed later, once). True when committed directly. Raises
    AuditUnavailableError only when the spool cannot be written either. ``content``, sealed
    before this call, is stored with the event either way, in the event's transaction.
    ``meanwhile`` runs on the caller's thread while the direct attempt commits (work that
    need not come before the commit); whatever it raises is raised once the event is safe."""
    attempted_at = datetime.now(UTC)
    attempt = (
        appender.submit(kind, actor, payload)
        if content is None
        else offload.submit_db(spool.commit, kind, actor, payload, content)
    )
    failure: BaseException | None = None
    if meanwhile is not None:
        # From the loop, the statement leaves in the append task's first step: let that run
        # first, so that ``meanwhile`` runs during the commit's flush instead of before it.
        await asyncio.sleep(0)
        try:
            meanwhile()
        except BaseException as error:  # the event is committed or spooled first
            failure = error
    committed = await _settle(offload, spool, kind, actor, payload, content, attempt, attempted_at)
    if failure is not None:
        raise failure
    return committed


async def _settle(
    offload: Offload,
    spool: EventSpool,
    kind: str,
    actor: str | None,
    payload: dict[str, Any],
    content: SealedContent | None,
    attempt: Future[AppendedEvent],
    attempted_at: datetime,
) -> bool:
    try:
        await offload.wait_db(attempt, f"{kind} append")
        return True
    except AuditUnavailableError as error:
        log.warning("event_spooled", kind=kind, error=str(error))
    try:
        await offload.io(spool.keep, kind, actor, payload, attempt, attempted_at, content)
    except OSError as error:
        raise AuditUnavailableError(f"audit spool unwritable: {error}") from error
    return False


def models_in_use(card: BackendCard) -> dict[str, Any]:
    """The model and every versioned artefact besides it, as `startup` and `request` events
    record them."""
    return {
        "model": card.model_name,
        "target_version": card.target_version,
        "artefacts": [dict(a) for a in card.artefacts],
    }


def recorded_artefacts(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The artefacts a `startup` or `request` event records. Events written before the
    generic list (the earliest format) named a draft model only, in ``draft``/``draft_version``;
    those read as the one ``draft_model`` artefact they describe."""
    if "artefacts" in payload:
        return [dict(a) for a in payload["artefacts"]]
    if payload.get("draft_version") is None:
        return []
    legacy_draft = {"name": payload.get("draft"), "version": payload["draft_version"]}
    return [{"kind": "draft_model", **legacy_draft}]


def served_model_record(model: ServedModel) -> dict[str, Any]:
    """One served model as the `startup` event records it."""
    card = model.backend.card
    return {
        **models_in_use(card),
        "backend": model.kind,
        "aliases": list(model.aliases),
        "available_methods": list(card.available_methods),
        "speculative_config": card.speculative_config,
        "max_context": card.max_context,
        "batching": card.batching,
        "dtype": card.dtype,
    }


def startup_payload(settings: Settings, models: ServedModels) -> dict[str, Any]:
    """The configuration and every served model (``models``); the first model's record is
    also at the top level, where the events of a gateway serving one model have it."""
    return {
        "config": settings.public_snapshot(),
        **served_model_record(models.first),
        "models": [served_model_record(model) for model in models],
    }


def request_payload(
    *,
    card: BackendCard,
    backend: str,
    principal: Principal,
    route: str,
    request_id: str,
    prompt_commitment: str,
    commitment_key: dict[str, Any],
    prompt_tokens: int,
    sampling: SamplingParams,
    n: int,
    speculative: SpeculativeChoice,
    stream: bool,
    subject_ref: str,
    store_content: bool,
    client_request_id: str | None = None,
    chat_template: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `request` event, committed before generation starts (fail closed). ``sampling.seed``
    is the effective seed: the client's, or the one drawn for it (``seed_drawn``); with the
    model versions, the speculative configuration and the completion's schedule it is what
    ``specgate audit replay`` needs; ``backend`` is what served the model (``local`` or
    ``vllm``). ``client_request_id`` is vLLM's ``request_id`` as the client sent it;
    ``chat_template`` the template options a chat prompt was rendered with
    (``template_record``; the prompt commitment covers the rendered text)."""
    return {
        "request_id": request_id,
        "route": route,
        "key_id": principal.key_id,
        "key_name": principal.name,
        "subject_ref": subject_ref,
        **models_in_use(card),
        "backend": backend,
        "speculative": {
            "requested_method": speculative.method,
            "requested_num_speculative_tokens": speculative.num_speculative_tokens,
            "default_method": card.default_method,
            "default_num_speculative_tokens": card.default_num_speculative_tokens,
            "config": card.speculative_config,
        },
        "sampling": {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "seed": sampling.seed,
            "seed_drawn": sampling.seed_drawn,
            "min_p": sampling.min_p,
            "stop": list(sampling.stop),
            "stop_token_ids": list(sampling.stop_token_ids),
            "ignore_eos": sampling.ignore_eos,
            "include_stop_str_in_output": sampling.include_stop_str_in_output,
            "skip_special_tokens": sampling.skip_special_tokens,
            "n": n,
            **processor_fields(sampling, with_text=store_content),
        },
        "stream": stream,
        "client_request_id": client_request_id,
        "chat_template": template_record(chat_template, with_text=store_content),
        "prompt_commitment": prompt_commitment,
        "commitment_key": commitment_key,
        "prompt_tokens": prompt_tokens,
    }


def run_lengths(values: Sequence[int]) -> list[list[int]]:
    """``[[value, count], ...]``: a per-step schedule, compactly (most steps repeat)."""
    runs: list[list[int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return runs


def expand_runs(runs: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(value for value, count in runs for _ in range(count))


def schedule_record(stats: GenerationStats | None) -> dict[str, Any] | None:
    """How one choice was decoded: the method used, whether fallback was on, the number of
    tokens proposed at each target pass (run-length encoded), and the most sequences a step
    of it shared (``GenerationStats.max_batch_size``)."""
    if stats is None:
        return None
    return {
        "method": stats.method,
        "fallback_active": stats.fallback_active,
        "proposal_lengths": run_lengths(stats.proposal_lengths),
        "max_batch_size": stats.max_batch_size,
    }


def processor_fields(sampling: SamplingParams, *, with_text: bool) -> dict[str, Any]:
    """The logits processors a request asked for. A constraint (JSON schema, regex, choices,
    grammar) is recorded by its kind and SHA-256, its text only with content storage on: a
    schema can say as much about the request as its prompt does."""
    fields: dict[str, Any] = {
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "logit_bias": {str(token): bias for token, bias in sampling.logit_bias},
        "min_tokens": sampling.min_tokens,
        "allowed_token_ids": list(sampling.allowed_token_ids),
        "bad_words": [list(word) for word in sampling.bad_words],
        "logprobs": sampling.logprobs,
        "constraint": None,
    }
    constraint = sampling.constraint
    if constraint is not None:
        digest = hashlib.sha256(constraint.spec.encode("utf-8")).hexdigest()
        fields["constraint"] = {"kind": constraint.kind, "sha256": digest}
        if with_text:
            fields["constraint"]["spec"] = constraint.spec
    return fields


def template_record(options: dict[str, Any] | None, *, with_text: bool) -> dict[str, Any] | None:
    """A chat prompt's template options. ``chat_template_kwargs`` are recorded by their names
    and the SHA-256 of their canonical JSON, their values only with content storage on: a
    template variable can carry as much of the request as its messages do."""
    if options is None:
        return None
    kwargs = options["chat_template_kwargs"]
    canonical = json.dumps(kwargs, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    recorded: dict[str, Any] = {
        "names": sorted(kwargs),
        "sha256": hashlib.sha256(canonical.encode("utf-8")).hexdigest(),
    }
    if with_text:
        recorded["values"] = kwargs
    return {**options, "chat_template_kwargs": recorded}


def combined_stats(all_stats: Sequence[GenerationStats]) -> GenerationStats | None:
    """One figure for all choices of a request: counts add up, fallback is any choice's."""
    if not all_stats:
        return None
    total = GenerationStats(method=all_stats[0].method)
    for stats in all_stats:
        total.add_counts(stats)
        total.num_prompt_tokens = stats.num_prompt_tokens
        total.num_output_tokens += stats.num_output_tokens
        total.fallback_active = total.fallback_active or stats.fallback_active
        total.total_time_s = max(total.total_time_s, stats.total_time_s)
        if stats.acceptance_source != "engine":
            total.acceptance_source = stats.acceptance_source
        total.replica = total.replica or stats.replica
    total.time_to_first_token_s = min(stats.time_to_first_token_s for stats in all_stats)
    return total


def completion_payload(
    *,
    request_event_id: str,
    outcome: str,
    error: str | None,
    commitments: Sequence[str],
    commitment_key: dict[str, Any],
    schedules: Sequence[dict[str, Any] | None],
    finish_reasons: Sequence[str | None],
    prompt_tokens: int,
    completion_tokens: int,
    stats: GenerationStats | None,
    latency_s: float,
) -> dict[str, Any]:
    """The `completion` event, referencing its `request` event: keyed commitments to each
    choice's text and how each choice was decoded."""
    payload: dict[str, Any] = {
        "request_event_id": request_event_id,
        "outcome": outcome,
        "error": error,
        "finish_reasons": list(finish_reasons),
        "completion_commitments": list(commitments),
        "commitment_key": commitment_key,
        "schedules": list(schedules),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "latency_s": latency_s,
        "speculative": None,
        "fallback_active": None,
    }
    if stats is not None:
        payload["speculative"] = stats.speculation()
        payload["replica"] = stats.replica
        payload["fallback_active"] = stats.fallback_active
        payload["time_to_first_token_s"] = stats.time_to_first_token_s
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


def drift_recorder(spool: EventSpool, instance_id: str) -> Callable[[dict[str, Any]], None]:
    """An `acceptance_drift` event per drift that starts (``gateway.observability.drift``),
    with the instance whose window saw it, through the durable spool like `fallback` events.
    The caller runs it off the event loop (the spool writes to disk); a spool that cannot be
    written is logged."""

    def record(drift: dict[str, Any]) -> None:
        try:
            spool.enqueue("acceptance_drift", None, {**drift, "instance_id": instance_id})
        except Exception:
            log.exception("drift_event_not_recorded", model=drift.get("model"))

    return record


def replica_recorder(spool: EventSpool) -> Callable[[Any], None]:
    """A remote backend's replica listener: a `backend_replica` event per replica taken out
    or put back, a `backend_replica_check` event per configuration check with news (each
    event's ``kind``), through the durable spool like `fallback` events (it runs on the
    backend's thread)."""

    def record(event: Any) -> None:
        try:
            spool.enqueue(event.kind, None, event.as_dict())
        except Exception:
            log.exception("replica_event_not_recorded", url=event.url, kind=event.kind)

    return record
