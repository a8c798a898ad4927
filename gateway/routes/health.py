"""``GET /healthz`` (the process answers; also as ``/livez`` and vLLM's ``/health``),
``GET /version`` (vLLM's: the Specgate version) and ``GET /readyz`` (it can serve: models
loaded, audit store reachable, no audit tampering detected and, if required, a fresh witness
cosignature). Unauthenticated, for orchestrators' probes."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway import specgate_version
from gateway.audit.log import AuditUnavailableError
from gateway.dependencies import Services
from gateway.errors import error_body
from gateway.notes import serving_notes

router = APIRouter(tags=["health"])


@router.get("/healthz")
@router.get("/livez")
@router.get("/health")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/version")
async def version() -> dict[str, str]:
    """vLLM's ``/version``: ``{"version": ...}``, here Specgate's."""
    return {"version": specgate_version()}


async def _audit_reachable(services: Services) -> bool:
    """A ping answered within ``audit_timeout_s``; probes share one ping in flight."""
    try:
        return await services.offload.db_shared("audit ping", services.audit.ping)
    except AuditUnavailableError:
        return False


async def _audit_integrity(services: Services) -> bool:
    """No tampering detected and, when required, a fresh witness cosignature (a database
    read, bounded like the ping)."""
    try:
        return await services.offload.db_shared("audit integrity", services.audit.integrity_ok)
    except AuditUnavailableError:
        return False


async def _audit_checks(services: Services | None) -> tuple[bool, bool]:
    """Reachability and integrity, asked at the same time: each call gives up after
    ``audit_timeout_s``, so the two together do too (one after the other, a stall held the
    probe for twice the bound)."""
    if services is None:
        return False, False
    reachable, integrity = await asyncio.gather(
        _audit_reachable(services), _audit_integrity(services)
    )
    return reachable, integrity


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready while every served model's backend is (``models``: each one's readiness): a
    gateway that cannot serve one of its models is taken out of rotation, so that requests
    for it go to an instance that can."""
    services: Services | None = request.app.state.services
    reachable, integrity = await _audit_checks(services)
    models = (
        {model.name: model.backend.health().ready for model in services.models} if services else {}
    )
    checks = {
        "engine": services is not None and not services.lifecycle.stopping and all(models.values()),
        "audit_store": reachable,
        "audit_integrity": integrity,
    }
    notes = (
        [
            note
            for model in services.models
            for note in serving_notes(model.settings, model.backend.card)
        ]
        if services
        else []
    )
    details = {"checks": checks, "models": models, "notes": notes}
    if all(checks.values()):
        return JSONResponse({"status": "ready", **details})
    failing = ", ".join(name for name, ok in checks.items() if not ok)
    body = error_body(f"Not ready: {failing} unavailable.", "service_unavailable", code="not_ready")
    return JSONResponse({**body, "status": "not_ready", **details}, status_code=503)
