"""Serving one audited generation over HTTP: admission, preparation off the event loop, the
audit receipt headers, and the stream that records its `completion` event however it ends.
Shared by every route that generates (chat, completions, responses)."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.dependencies import Services
from gateway.errors import APIError, shutting_down
from gateway.generation.audited import AuditedGeneration
from gateway.generation.job import build_job
from gateway.keys import Principal
from gateway.schemas import ChatCompletionRequest, CompletionRequest

AUDIT_ID_HEADER = "x-specgate-audit-id"
# The receipt: the `request` event's Merkle leaf index and leaf hash (base64), which
# GET /v1/audit/proof/{audit id} proves included in a signed checkpoint.
AUDIT_LEAF_INDEX_HEADER = "x-specgate-audit-leaf-index"
AUDIT_LEAF_HASH_HEADER = "x-specgate-audit-leaf-hash"


def audit_headers(generation: AuditedGeneration) -> dict[str, str]:
    event = generation.request_event
    assert event is not None
    return {
        AUDIT_ID_HEADER: generation.audit_id,
        AUDIT_LEAF_INDEX_HEADER: str(event.leaf_index),
        AUDIT_LEAF_HASH_HEADER: base64.b64encode(event.leaf_hash).decode("ascii"),
    }


class AuditedStream(StreamingResponse):
    """A stream that records its `completion` event even when the client leaves before the
    first chunk (Starlette then never starts the body generator), and frees its slots."""

    def __init__(self, generation: AuditedGeneration, events: AsyncIterator[str]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={**audit_headers(generation), "cache-control": "no-cache"},
        )
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            generation = self.generation
            if not generation.closed:
                for handle in generation.handles:
                    handle.cancel()
                with anyio.CancelScope(shield=True):
                    await generation.close_quietly("cancelled", "the client disconnected")
            generation.finish()


async def start(
    body: ChatCompletionRequest | CompletionRequest, principal: Principal, services: Services
) -> AuditedGeneration:
    """Route to the model the request names (or 404), admit (or 429 at once) and check the
    key's quotas (or 429), then template and tokenize off the event loop."""
    if services.lifecycle.stopping:
        services.refusals.count(principal.key_id, "shutting_down")
        raise shutting_down("The gateway is shutting down; retry on another instance.")
    model = services.models.resolve(body.model)
    try:
        slots = services.admission.admit(body.n)
    except APIError as refusal:
        services.refusals.count(principal.key_id, refusal.code or "queue_full")
        raise
    try:
        ticket = await services.quotas.admit(principal)
    except APIError as refusal:
        slots.release()
        services.refusals.count(principal.key_id, refusal.code or "rate_limit_exceeded")
        raise
    except BaseException:
        slots.release()
        raise
    try:
        job = await services.offload.prepare(
            build_job,
            body,
            model.backend,
            services.settings.max_prompt_bytes,
            services.settings.store_content
            if principal.store_content is None
            else principal.store_content,
        )
    except BaseException:
        slots.release()
        raise
    return AuditedGeneration(services, principal, model, job, slots, quota=ticket)


async def serve_stream(
    generation: AuditedGeneration,
    events: Callable[[list[Any]], AsyncIterator[str]],
) -> StreamingResponse:
    """Commit the `request` event and start the backend, then stream ``events(handles)``."""
    try:
        handles = await generation.open()
    except BaseException:
        generation.finish()
        raise
    return AuditedStream(generation, events(handles))


async def answer(
    generation: AuditedGeneration, render: Callable[[list[Any]], JSONResponse]
) -> JSONResponse:
    """The non-streaming answer, rendered while the `completion` event commits."""
    try:
        return await generation.run(render)
    finally:
        generation.finish()
