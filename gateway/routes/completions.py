"""``POST /v1/chat/completions`` and ``POST /v1/completions`` (``app`` role)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.auth import AppPrincipal
from gateway.dependencies import Services, ServicesDep
from gateway.generation.audited import AuditedGeneration
from gateway.generation.replies import chat_logprobs, chat_message, completion_logprobs
from gateway.generation.stream import system_fingerprint
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
from gateway.serving import answer, audit_headers, serve_stream, start

router = APIRouter(prefix="/v1", tags=["completions"], route_class=CheckedBodyRoute)


def _envelope(generation: AuditedGeneration) -> dict[str, Any]:
    """What a chat and a text completion share besides their choices."""
    job, card = generation.job, generation.backend.card
    return {
        "id": job.response_id,
        "created": job.created,
        "model": card.model_name,
        "system_fingerprint": system_fingerprint(card),
        "usage": Usage(**generation.usage()),
        "speculative": generation.speculative(),
    }


def _chat(generation: AuditedGeneration, results: list[Any]) -> ChatCompletion:
    choices = []
    for index, result in enumerate(results):
        message, finish_reason = chat_message(generation.job, result.text, result.finish_reason)
        choices.append(
            ChatChoice(
                index=index,
                message=message,
                finish_reason=finish_reason,
                logprobs=chat_logprobs(result.logprobs),
            )
        )
    return ChatCompletion(**_envelope(generation), choices=choices)


def _completion(generation: AuditedGeneration, results: list[Any]) -> Completion:
    choices = [
        CompletionChoice(
            index=index,
            text=result.text,
            finish_reason=result.finish_reason,
            logprobs=completion_logprobs(result.logprobs),
        )
        for index, result in enumerate(results)
    ]
    return Completion(**_envelope(generation), choices=choices)


async def _serve(
    body: ChatCompletionRequest | CompletionRequest,
    principal: Principal,
    services: Services,
    build: Callable[[AuditedGeneration, list[Any]], ChatCompletion | Completion],
) -> JSONResponse | StreamingResponse:
    """Stream the generation, or answer once its `completion` event commits."""
    generation = await start(body, principal, services)
    if generation.job.stream:
        return await serve_stream(generation, generation.stream)

    def render(results: list[Any]) -> JSONResponse:
        content: dict[str, Any] = build(generation, results).model_dump(mode="json")
        return JSONResponse(content, headers=audit_headers(generation))

    return await answer(generation, render)


@router.post("/chat/completions", response_model=ChatCompletion)
async def chat_completions(
    body: ChatCompletionRequest, principal: AppPrincipal, services: ServicesDep
) -> JSONResponse | StreamingResponse:
    return await _serve(body, principal, services, _chat)


@router.post("/completions", response_model=Completion)
async def completions(
    body: CompletionRequest, principal: AppPrincipal, services: ServicesDep
) -> JSONResponse | StreamingResponse:
    return await _serve(body, principal, services, _completion)
