"""``GET /v1/models`` and ``GET /v1/models/{model}`` (``app`` role)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from engine.service import Engine
from gateway.auth import AppPrincipal
from gateway.dependencies import EngineDep
from gateway.generation import check_model
from gateway.schemas import ModelCard, ModelList

router = APIRouter(prefix="/v1", tags=["models"])


def _card(engine: Engine, created: int) -> ModelCard:
    return ModelCard(
        id=engine.model_name,
        created=created,
        target_version=engine.target_version,
        draft=engine.draft_name,
        draft_version=engine.draft_version,
        speculative_methods=list(engine.available_methods),
        max_context=engine.max_context,
    )


@router.get("/models")
async def list_models(request: Request, principal: AppPrincipal, engine: EngineDep) -> ModelList:
    return ModelList(data=[_card(engine, request.app.state.started_at)])


@router.get("/models/{model:path}")
async def retrieve_model(
    model: str, request: Request, principal: AppPrincipal, engine: EngineDep
) -> ModelCard:
    check_model(model, engine)
    return _card(engine, request.app.state.started_at)
