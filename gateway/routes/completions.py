"""``POST /v1/chat/completions`` and ``POST /v1/completions`` (``app`` role)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.auth import AppPrincipal
from gateway.dependencies import ServicesDep
from gateway.generation import (
    AuditedGeneration,
    chat_logprobs,
    chat_message,
    completion_logprobs,
    system_fingerprint,
)
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
from gateway.serving import answer, audit_headers, serve_stream, start

router = APIRouter(prefix="/v1", tags=["completions"], route_class=CheckedBodyRoute)


def _json(body: ChatCompletion | Completion, generation: AuditedGeneration) -> JSONResponse:
    content: dict[str, Any] = body.model_dump(mode="json")
    return JSONResponse(content, headers=audit_headers(generation))


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
    generation = await start(body, principal, services)
    if generation.job.stream:
        return await serve_stream(generation, generation.stream)
    job = generation.job

    def render(results: list[Any]) -> JSONResponse:
        return _json(
            ChatCompletion(
                id=job.response_id,
                created=job.created,
                model=generation.backend.card.model_name,
                system_fingerprint=system_fingerprint(generation.backend.card),
                choices=[_chat_choice(generation, i, r) for i, r in enumerate(results)],
                usage=Usage(**generation.usage()),
                speculative=generation.speculative(),
            ),
            generation,
        )

    return await answer(generation, render)


@router.post("/completions", response_model=Completion)
async def completions(
    body: CompletionRequest, principal: AppPrincipal, services: ServicesDep
) -> JSONResponse | StreamingResponse:
    generation = await start(body, principal, services)
    if generation.job.stream:
        return await serve_stream(generation, generation.stream)
    job = generation.job

    def render(results: list[Any]) -> JSONResponse:
        return _json(
            Completion(
                id=job.response_id,
                created=job.created,
                model=generation.backend.card.model_name,
                system_fingerprint=system_fingerprint(generation.backend.card),
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

    return await answer(generation, render)
