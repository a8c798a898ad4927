"""``POST /tokenize`` and ``POST /detokenize``, vLLM's (``app`` role)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.auth import AppPrincipal
from gateway.dependencies import ServicesDep
from gateway.request_body import CheckedBodyRoute
from gateway.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)

router = APIRouter(tags=["tokenize"], route_class=CheckedBodyRoute)


@router.post("/tokenize")
async def tokenize_prompt(
    body: TokenizeRequest, principal: AppPrincipal, services: ServicesDep
) -> TokenizeResponse:
    backend = services.models.resolve(body.model).backend
    return await services.offload.prepare(
        tokenize, body, backend, services.settings.max_prompt_bytes
    )


@router.post("/detokenize")
async def detokenize_tokens(
    body: DetokenizeRequest, principal: AppPrincipal, services: ServicesDep
) -> DetokenizeResponse:
    backend = services.models.resolve(body.model).backend
    return await services.offload.prepare(detokenize, body, backend)
