"""Replay of an audited request (``auditor`` or ``admin``): re-run on the loaded models,
compare with the record's commitment, and record that it was done (a `replay` event)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from engine.api.types import Method
from gateway.auth import authenticated
from gateway.dependencies import ServicesDep
from gateway.errors import APIError
from gateway.keys import Principal
from gateway.privacy.replay import ReplayRefusedError, find_recorded, replay

router = APIRouter(prefix="/v1/audit", tags=["audit"])


async def _auditor_or_admin(
    principal: Annotated[Principal, Depends(authenticated)],
) -> Principal:
    if principal.role not in ("auditor", "admin"):
        raise APIError(
            403,
            f"Replay needs an 'auditor' or 'admin' key; this key has '{principal.role}'.",
            type="permission_error",
            code="insufficient_role",
        )
    return principal


@router.post("/replay/{event_id}")
async def replay_request(
    event_id: str,
    principal: Annotated[Principal, Depends(_auditor_or_admin)],
    services: ServicesDep,
    method: Method | None = None,
) -> dict[str, Any]:
    """Re-run the request recorded by `request` event ``event_id``; with ``method`` (greedy
    requests only) under another speculation method."""
    try:
        recorded = await run_in_threadpool(find_recorded, services.audit, services.db, event_id)
        # On the model the request was served by; where it is no longer served, on the first
        # (the report then lists how the loaded model differs from the recorded one).
        model = services.models.find(str(recorded.request.payload.get("model")))
        backend = (model or services.models.first).backend
        report = await replay(backend, services.privacy, recorded, method)
    except ReplayRefusedError as error:
        raise APIError(error.status, str(error), code="replay_refused") from None
    await services.offload.db(
        services.audit.append,
        "replay",
        principal.key_id,
        {
            "request_event_id": event_id,
            "replayed": report["replayed"],
            "match": report["match"],
            "method": method,
            "differences": report["differences"],
        },
    )
    return report
