"""``GET /healthz`` (the process answers) and ``GET /readyz`` (it can serve: models loaded,
audit store reachable, no audit tampering detected and, if required, a fresh witness
cosignature). Unauthenticated, for orchestrators' probes."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from gateway.dependencies import Services
from gateway.errors import error_body

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    services: Services | None = request.app.state.services
    checks = {
        "engine": services is not None,
        "audit_store": services is not None and await run_in_threadpool(services.audit.ping),
        "audit_integrity": services is not None
        and await run_in_threadpool(services.audit.integrity_ok),
    }
    if all(checks.values()):
        return JSONResponse({"status": "ready", "checks": checks})
    failing = ", ".join(name for name, ok in checks.items() if not ok)
    body = error_body(f"Not ready: {failing} unavailable.", "service_unavailable", code="not_ready")
    return JSONResponse({**body, "status": "not_ready", "checks": checks}, status_code=503)
