"""Replay of an audited request on the loaded models (``specgate audit replay``).

A `request` event records the effective seed, the requested method and K, the model and
artefact versions and the speculative configuration; its `completion` event records, per
choice, the method used, whether fallback was on, the tokens proposed at each target pass and
the most sequences one of its steps shared. Replaying with that schedule draws exactly what
the original drew, so the same method and configuration give a bit-identical completion: the
replay's keyed commitment must equal the recorded one, where the original ran alone, in
float32, or in the batch-invariant mode. A choice whose steps shared a batch
(``shared_batch`` above 1) in bfloat16 outside that mode may differ where a near-tie rounded
the other way in the shared pass. Where a version or the configuration differs, the replay
names it and claims no match. Asked for another method (greedy only), it compares the tokens
with the recorded ones and gives the first differing position; and, for each speculative
output, where it first leaves plain greedy decoding with the target's logit gap there
(``engine.speculation.divergence``: plain decoding is the reference the gap is measured
against, re-run when neither output is plain).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError

from engine.api.types import (
    Constraint,
    GenerationRequest,
    Method,
    SamplingParams,
    SpeculativeChoice,
)
from engine.speculation.divergence import first_difference
from gateway.audit.log import AuditLog, AuditUnavailableError, record_from_row
from gateway.audit.records import EventRecord
from gateway.audit.schema import audit_events
from gateway.backends.base import BackendCard, GenerationBackend
from gateway.privacy.commitments import ContentUnreadableError, text_bytes
from gateway.privacy.store import PrivacyStore
from gateway.recording import expand_runs, recorded_artefacts


class ReplayRefusedError(ValueError):
    """The request cannot be replayed (unknown, not completed, content not stored or
    erased, another method asked for a sampled request); ``status`` is the HTTP answer."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Recorded:
    request: EventRecord
    completion: EventRecord


def find_recorded(audit: AuditLog, db: sa.Engine, event_id: str) -> Recorded:
    request = audit.event(event_id)
    if request is None or request.kind != "request":
        raise ReplayRefusedError(f"no request event {event_id}", 404)
    query = (
        sa.select(audit_events)
        .where(
            audit_events.c.kind == "completion",
            audit_events.c.payload["request_event_id"].as_string() == event_id,
        )
        .order_by(audit_events.c.seq)
        .limit(1)
    )
    try:
        with db.connect() as connection:
            row = connection.execute(query).first()
    except SQLAlchemyError as exc:
        raise AuditUnavailableError(f"audit store unavailable: {exc}") from exc
    if row is None:
        raise ReplayRefusedError(f"request {event_id} has no completion event")
    completion = record_from_row(row)
    if completion.payload.get("outcome") != "ok":
        raise ReplayRefusedError(
            f"request {event_id} did not complete ({completion.payload.get('outcome')})"
        )
    return Recorded(request, completion)


def configuration_differences(payload: dict[str, Any], card: BackendCard) -> list[str]:
    """What the loaded models and configuration have that the record does not."""
    differences = []
    for field, now in (("model", card.model_name), ("target_version", card.target_version)):
        if payload.get(field) != now:
            differences.append(f"{field}: recorded {payload.get(field)!r}, loaded {now!r}")
    recorded_versions = _versions(recorded_artefacts(payload))
    loaded_versions = _versions(card.artefacts)
    if recorded_versions != loaded_versions:
        differences.append(f"artefacts: recorded {recorded_versions}, loaded {loaded_versions}")
    recorded = payload.get("speculative", {}).get("config")
    if recorded != card.speculative_config:
        differences.append(
            f"speculative config: recorded {recorded!r}, loaded {card.speculative_config!r}"
        )
    return differences


def _versions(artefacts: Sequence[Mapping[str, Any]]) -> list[tuple[Any, Any]]:
    """(kind, version) of each artefact: what must match for a replay (names may differ)."""
    return sorted(((a.get("kind"), a.get("version")) for a in artefacts), key=str)


def _sampling(payload: dict[str, Any], index: int) -> SamplingParams:
    """The recorded sampling parameters, logits processors included. A constraint is
    recorded with its text only when the request's content was stored; without it the
    request cannot be re-run."""
    sampling = payload["sampling"]
    recorded = sampling.get("constraint")
    constraint = None
    if recorded is not None:
        if "spec" not in recorded:
            raise ReplayRefusedError("the request's constraint was recorded by its hash only")
        constraint = Constraint(kind=recorded["kind"], spec=recorded["spec"])
    return SamplingParams(
        max_tokens=sampling["max_tokens"],
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        top_k=sampling["top_k"],
        min_p=sampling.get("min_p", 0.0),
        seed=sampling["seed"] + index,
        stop=tuple(sampling["stop"]),
        stop_token_ids=tuple(sampling.get("stop_token_ids", ())),
        ignore_eos=sampling.get("ignore_eos", False),
        include_stop_str_in_output=sampling.get("include_stop_str_in_output", False),
        skip_special_tokens=sampling.get("skip_special_tokens", True),
        seed_drawn=sampling.get("seed_drawn", False),
        presence_penalty=sampling.get("presence_penalty", 0.0),
        frequency_penalty=sampling.get("frequency_penalty", 0.0),
        repetition_penalty=sampling.get("repetition_penalty", 1.0),
        logit_bias=tuple(
            (int(token), bias) for token, bias in sampling.get("logit_bias", {}).items()
        ),
        min_tokens=sampling.get("min_tokens", 0),
        allowed_token_ids=tuple(sampling.get("allowed_token_ids", ())),
        bad_words=tuple(tuple(word) for word in sampling.get("bad_words", ())),
        constraint=constraint,
        logprobs=sampling.get("logprobs"),
    )


def _recorded_choice(schedule: dict[str, Any]) -> SpeculativeChoice:
    method: Method = "none" if schedule["fallback_active"] else schedule["method"]
    return SpeculativeChoice(method=method, schedule=expand_runs(schedule["proposal_lengths"]))


async def _divergences_from_plain(
    backend: GenerationBackend,
    prompt_ids: tuple[int, ...],
    sampling: SamplingParams,
    outputs: dict[str, tuple[Method | None, list[int]]],
) -> list[dict[str, Any]] | None:
    """Where each speculative greedy output (by name: ``recorded``, ``replayed``) first
    differs from plain greedy decoding, with the target's logit gap there and whether the
    dtype's rounding explains it. Plain decoding is the reference: the output decoded with
    method ``none``, or a plain re-run when neither was. None for a backend that does not
    see the target's logits."""
    divergence = backend.divergence
    if divergence is None:
        return None
    plain = next((ids for method, ids in outputs.values() if method == "none"), None)
    if plain is None:
        rerun = backend.submit(
            GenerationRequest(prompt_ids, sampling, SpeculativeChoice(method="none"), "replay")
        )
        plain = list((await rerun.result_async()).token_ids)
    found = []
    for name, (method, ids) in outputs.items():
        if method == "none":
            continue
        at = await asyncio.to_thread(divergence, prompt_ids, plain, ids)
        if at is not None:
            found.append({"output": name, "method": method, **at})
    return found


async def replay(
    backend: GenerationBackend,
    privacy: PrivacyStore,
    recorded: Recorded,
    method: Method | None = None,
) -> dict[str, Any]:
    """Re-run ``recorded`` on ``backend``; the report (see the module docstring). CPU and
    database work runs on worker threads."""
    request, completion = recorded.request.payload, recorded.completion.payload
    schedules = completion.get("schedules")
    if "content" not in request or not isinstance(schedules, list):
        raise ReplayRefusedError("this request's content was not stored: it cannot be replayed")
    differences = configuration_differences(request, backend.card)
    report: dict[str, Any] = {
        "request_event_id": recorded.request.event_id,
        "completion_event_id": recorded.completion.event_id,
        "differences": differences,
        "choices": [],
    }
    if differences:
        return {**report, "replayed": False, "match": False}
    key_ref = request["commitment_key"].get("key_ref")
    try:
        key = await asyncio.to_thread(privacy.existing_key, key_ref)
        if key is None:
            raise ReplayRefusedError("cannot replay: the content was erased")
        prompt = await asyncio.to_thread(privacy.read_content, request["content"])
        output = await asyncio.to_thread(privacy.read_content, completion["content"])
    except (ContentUnreadableError, KeyError) as error:
        raise ReplayRefusedError(f"cannot replay: {error}") from None
    greedy = request["sampling"]["temperature"] == 0.0
    if method is not None and not greedy:
        raise ReplayRefusedError("another method can only be compared for greedy requests", 400)
    prompt_ids = tuple(prompt["prompt_token_ids"])
    for index, schedule in enumerate(schedules):
        choice = _recorded_choice(schedule)
        if method is not None:
            choice = SpeculativeChoice(method=method)
        generation = backend.submit(
            GenerationRequest(prompt_ids, _sampling(request, index), choice, "replay")
        )
        result = await generation.result_async()
        commitment = key.commitments.commit(text_bytes(result.text))
        recorded_ids = output["choices"][index]["token_ids"]
        entry: dict[str, Any] = {
            "index": index,
            "method": choice.method,
            "match": commitment == completion["completion_commitments"][index],
            "completion_tokens": len(result.token_ids),
            # What the original's steps shared (None: unknown): outside the batch-invariant
            # mode, a bfloat16 step shared with others may round a near-tie the other way.
            "shared_batch": schedule.get("max_batch_size", 1),
        }
        if not entry["match"] and method is not None:
            entry["first_difference"] = first_difference(recorded_ids, result.token_ids)
            outputs: dict[str, tuple[Method | None, list[int]]] = {
                "recorded": (_recorded_choice(schedule).method, list(recorded_ids)),
                "replayed": (method, list(result.token_ids)),
            }
            divergences = await _divergences_from_plain(
                backend, prompt_ids, _sampling(request, index), outputs
            )
            if divergences is not None:
                entry["divergences"] = divergences
        report["choices"].append(entry)
    match = all(choice["match"] for choice in report["choices"])
    return {**report, "replayed": True, "match": match, "method": method}
