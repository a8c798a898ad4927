"""``POST /v1/chat/completions`` and ``POST /v1/completions`` (``app`` role)."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import anyio
from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.auth import AppPrincipal
from gateway.dependencies import Services, ServicesDep
from gateway.errors import APIError, shutting_down
from gateway.generation import (
    AuditedGeneration,
    build_job,
    chat_logprobs,
    chat_message,
    completion_logprobs,
    system_fingerprint,
)
from gateway.keys import Principal
from gateway.request_body import CheckedBodyRoute
from gateway.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Usage,
)

router = APIRouter(prefix="/v1", tags=["completions"], route_class=CheckedBodyRoute)

AUDIT_ID_HEADER = "x-specgate-audit-id"
# The receipt: the `request` event's Merkle leaf index and leaf hash (base64), which
# GET /v1/audit/proof/{audit id} proves included in a signed checkpoint.
AUDIT_LEAF_INDEX_HEADER = "x-specgate-audit-leaf-index"
AUDIT_LEAF_HASH_HEADER = "x-specgate-audit-leaf-hash"


def _audit_headers(generation: AuditedGeneration) -> dict[str, str]:
    event = generation.request_event
    assert event is not None
    return {
        AUDIT_ID_HEADER: generation.audit_id,
        AUDIT_LEAF_INDEX_HEADER: str(event.leaf_index),
        AUDIT_LEAF_HASH_HEADER: base64.b64encode(event.leaf_hash).decode("ascii"),
    }


class _AuditedStream(StreamingResponse):
    """A stream that records its `completion` event even when the client leaves before the
    first chunk (Starlette then never starts the body generator), and frees its slots."""

    def __init__(self, generation: AuditedGeneration, handles: list[Any]) -> None:
        super().__init__(
            generation.stream(handles),
            media_type="text/event-stream",
            headers={**_audit_headers(generation), "cache-control": "no-cache"},
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


async def _start(
    body: ChatCompletionRequest | CompletionRequest, principal: Principal, services: Services
) -> AuditedGeneration:
    """Admit (or 429 at once), then template and tokenize off the event loop."""
    if services.lifecycle.stopping:
        services.refusals.count(principal.key_id, "shutting_down")
        raise shutting_down("The gateway is shutting down; retry on another instance.")
    try:
        slots = services.admission.admit(body.n)
    except APIError as refusal:
        services.refusals.count(principal.key_id, refusal.code or "queue_full")
        raise
    try:
        job = await services.offload.prepare(
            build_job,
            body,
            services.backend,
            services.settings.max_prompt_bytes,
            services.settings.store_content
            if principal.store_content is None
            else principal.store_content,
        )
    except BaseException:
        slots.release()
        raise
    return AuditedGeneration(services, principal, job, slots)


async def _serve(generation: AuditedGeneration) -> StreamingResponse | None:
    """Start the generation; streams answer at once, the rest return None to be rendered."""
    if not generation.job.stream:
        return None
    try:
        handles = await generation.open()
    except BaseException:
        generation.finish()
        raise
    return _AuditedStream(generation, handles)


async def _answer(
    generation: AuditedGeneration, render: Callable[[list[Any]], JSONResponse]
) -> JSONResponse:
    """The non-streaming answer, rendered while the `completion` event commits."""
    try:
        return await generation.run(render)
    finally:
        generation.finish()


def _json(body: ChatCompletion | Completion, generation: AuditedGeneration) -> JSONResponse:
    content: dict[str, Any] = body.model_dump(mode="json")
    return JSONResponse(content, headers=_audit_headers(generation))


def _chat_choice(generation: AuditedGeneration, index: int, result: Any) -> ChatChoice:
    message, finish_reason = chat_message(generation.job, result.text, result.finish_reason)
    return ChatChoice(
        index=index,
        message=message,
        finish_reason=finish_reason,
        logprobs=chat_logprobs(result.logprobs),
    )


@router.post("/chat/completions", response_model=ChatCompletion)
async def chat_completions(
    body: ChatCompletionRequest, principal: AppPrincipal, services: ServicesDep
) -> JSONResponse | StreamingResponse:
    generation = await _start(body, principal, services)
    streaming = await _serve(generation)
    if streaming is not None:
        return streaming
    job = generation.job

    def render(results: list[Any]) -> JSONResponse:
        return _json(
            ChatCompletion(
                id=job.response_id,
                created=job.created,
                model=services.backend.card.model_name,
                system_fingerprint=system_fingerprint(services.backend.card),
                choices=[_chat_choice(generation, i, r) for i, r in enumerate(results)],
                usage=Usage(**generation.usage()),
                speculative=generation.speculative(),
            ),
            generation,
        )

    return await _answer(generation, render)


@router.post("/completions", response_model=Completion)
async def completions(
    body: CompletionRequest, principal: AppPrincipal, services: ServicesDep
) -> JSONResponse | StreamingResponse:
    generation = await _start(body, principal, services)
    streaming = await _serve(generation)
    if streaming is not None:
        return streaming
    job = generation.job

    def render(results: list[Any]) -> JSONResponse:
        return _json(
            Completion(
                id=job.response_id,
                created=job.created,
                model=services.backend.card.model_name,
                system_fingerprint=system_fingerprint(services.backend.card),
                choices=[
                    CompletionChoice(
                        index=i,
                        text=r.text,
                        finish_reason=r.finish_reason,
                        logprobs=completion_logprobs(r.logprobs),
                    )
                    for i, r in enumerate(results)
                ],
                usage=Usage(**generation.usage()),
                speculative=generation.speculative(),
            ),
            generation,
        )

    return await _answer(generation, render)
