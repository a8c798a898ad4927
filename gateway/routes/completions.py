"""``POST /v1/chat/completions`` and ``POST /v1/completions`` (``app`` role)."""

from __future__ import annotations

import base64
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.auth import AppPrincipal
from gateway.dependencies import ServicesDep
from gateway.generation import AuditedGeneration, build_job, system_fingerprint
from gateway.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ResponseMessage,
    Usage,
)

router = APIRouter(prefix="/v1", tags=["completions"])

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


async def _serve(generation: AuditedGeneration) -> JSONResponse | StreamingResponse | None:
    """Start the generation; streams answer at once, the rest return None to be rendered."""
    if not generation.job.stream:
        return None
    handles = await generation.open()
    return StreamingResponse(
        generation.stream(handles),
        media_type="text/event-stream",
        headers={**_audit_headers(generation), "cache-control": "no-cache"},
    )


def _json(body: ChatCompletion | Completion, generation: AuditedGeneration) -> JSONResponse:
    content: dict[str, Any] = body.model_dump(mode="json")
    return JSONResponse(content, headers=_audit_headers(generation))


@router.post("/chat/completions", response_model=ChatCompletion)
async def chat_completions(
    body: ChatCompletionRequest, principal: AppPrincipal, services: ServicesDep
) -> JSONResponse | StreamingResponse:
    generation = AuditedGeneration(services, principal, build_job(body, services.engine))
    streaming = await _serve(generation)
    if streaming is not None:
        return streaming
    results = await generation.run()
    job = generation.job
    return _json(
        ChatCompletion(
            id=job.response_id,
            created=job.created,
            model=services.engine.model_name,
            system_fingerprint=system_fingerprint(services.engine),
            choices=[
                ChatChoice(
                    index=i, message=ResponseMessage(content=r.text), finish_reason=r.finish_reason
                )
                for i, r in enumerate(results)
            ],
            usage=Usage(**generation.usage()),
            speculative=generation.speculative(),
        ),
        generation,
    )


@router.post("/completions", response_model=Completion)
async def completions(
    body: CompletionRequest, principal: AppPrincipal, services: ServicesDep
) -> JSONResponse | StreamingResponse:
    generation = AuditedGeneration(services, principal, build_job(body, services.engine))
    streaming = await _serve(generation)
    if streaming is not None:
        return streaming
    results = await generation.run()
    job = generation.job
    return _json(
        Completion(
            id=job.response_id,
            created=job.created,
            model=services.engine.model_name,
            system_fingerprint=system_fingerprint(services.engine),
            choices=[
                CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason)
                for i, r in enumerate(results)
            ],
            usage=Usage(**generation.usage()),
            speculative=generation.speculative(),
        ),
        generation,
    )
