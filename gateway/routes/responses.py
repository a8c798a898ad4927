"""``POST /v1/responses``, OpenAI's Responses API (``app`` role), served as the chat
completion it translates to (``gateway.responses_api``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.auth import AppPrincipal
from gateway.dependencies import ServicesDep
from gateway.request_body import CheckedBodyRoute
from gateway.responses_api import (
    chat_request,
    completed_response,
    response_stream,
    responses_params,
)
from gateway.responses_schemas import ResponseRequest
from gateway.serving import answer, audit_headers, serve_stream, start

router = APIRouter(prefix="/v1", tags=["responses"], route_class=CheckedBodyRoute)


@router.post("/responses", response_model=None)
async def create_response(
    body: ResponseRequest, principal: AppPrincipal, services: ServicesDep
) -> JSONResponse | StreamingResponse:
    with responses_params():
        generation = await start(chat_request(body), principal, services)
    if body.stream:
        return await serve_stream(
            generation,
            lambda handles: response_stream(body, generation, generation.stream(handles)),
        )

    def render(results: list[Any]) -> JSONResponse:
        (result,) = results
        content = completed_response(body, generation, result.text, result.finish_reason)
        return JSONResponse(content, headers=audit_headers(generation))

    return await answer(generation, render)
