"""``GET /v1/models`` and ``GET /v1/models/{model}`` (``app`` role): every served model, with
its aliases; a model is retrieved by its name or an alias."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.auth import AppPrincipal
from gateway.dependencies import ServicesDep
from gateway.notes import serving_notes
from gateway.schemas import Artefact, ModelCard, ModelList
from gateway.served_models import ServedModel

router = APIRouter(prefix="/v1", tags=["models"])


def _card(model: ServedModel, created: int) -> ModelCard:
    card = model.backend.card
    return ModelCard(
        id=card.model_name,
        created=created,
        aliases=list(model.aliases),
        target_version=card.target_version,
        artefacts=[Artefact.model_validate(a) for a in card.artefacts],
        speculative_methods=list(card.available_methods),
        max_context=card.max_context,
        dtype=card.dtype,
        notes=serving_notes(model.settings, card),
    )


@router.get("/models")
async def list_models(
    request: Request, principal: AppPrincipal, services: ServicesDep
) -> ModelList:
    created = request.app.state.started_at
    return ModelList(data=[_card(model, created) for model in services.models])


@router.get("/models/{model:path}")
async def retrieve_model(
    model: str, request: Request, principal: AppPrincipal, services: ServicesDep
) -> ModelCard:
    return _card(services.models.resolve(model), request.app.state.started_at)
