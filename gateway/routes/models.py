"""``GET /v1/models`` and ``GET /v1/models/{model}`` (``app`` role)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.auth import AppPrincipal
from gateway.backends.base import BackendCard
from gateway.dependencies import ServicesDep
from gateway.generation import check_model
from gateway.notes import serving_notes
from gateway.schemas import Artefact, ModelCard, ModelList

router = APIRouter(prefix="/v1", tags=["models"])


def _card(card: BackendCard, created: int, notes: list[str]) -> ModelCard:
    return ModelCard(
        id=card.model_name,
        created=created,
        target_version=card.target_version,
        artefacts=[Artefact.model_validate(a) for a in card.artefacts],
        speculative_methods=list(card.available_methods),
        max_context=card.max_context,
        dtype=card.dtype,
        notes=notes,
    )


@router.get("/models")
async def list_models(
    request: Request, principal: AppPrincipal, services: ServicesDep
) -> ModelList:
    card = services.backend.card
    notes = serving_notes(services.settings, card)
    return ModelList(data=[_card(card, request.app.state.started_at, notes)])


@router.get("/models/{model:path}")
async def retrieve_model(
    model: str, request: Request, principal: AppPrincipal, services: ServicesDep
) -> ModelCard:
    card = services.backend.card
    check_model(model, card)
    return _card(card, request.app.state.started_at, serving_notes(services.settings, card))
