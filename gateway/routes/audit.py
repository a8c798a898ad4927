"""Audit endpoints for the ``auditor`` role: export, server-side verification, public key."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from gateway.auth import AuditorPrincipal
from gateway.dependencies import AuditDep
from gateway.errors import APIError

router = APIRouter(prefix="/v1/audit", tags=["audit"])

_MEDIA_TYPES = {"jsonl": "application/x-ndjson", "csv": "text/csv; charset=utf-8"}


def _check_range(since: datetime | None, until: datetime | None) -> None:
    if since is not None and until is not None and since >= until:
        raise APIError(400, "'since' must be earlier than 'until'.", param="since")


@router.get("/export")
async def export(
    principal: AuditorPrincipal,
    audit: AuditDep,
    since: datetime | None = None,
    until: datetime | None = None,
    format: Literal["jsonl", "csv"] = "jsonl",
) -> StreamingResponse:
    """The events created in [since, until) and a signed checkpoint covering them.

    The first line is produced before the response starts, so that an unreachable store is
    a 503 rather than a truncated 200.
    """
    _check_range(since, until)
    lines = await run_in_threadpool(audit.export, since, until, format, principal.key_id)
    first = await run_in_threadpool(next, lines)

    def rest() -> Iterator[str]:
        yield first
        yield from lines

    stamp = datetime.now().strftime("%Y%m%dT%H%M%S")
    return StreamingResponse(
        iterate_in_threadpool(rest()),
        media_type=_MEDIA_TYPES[format],
        headers={"content-disposition": f'attachment; filename="specgate-audit-{stamp}.{format}"'},
    )


@router.get("/verify")
async def verify(
    principal: AuditorPrincipal,
    audit: AuditDep,
    since: datetime | None = None,
    until: datetime | None = None,
) -> dict[str, Any]:
    _check_range(since, until)
    report = await run_in_threadpool(audit.verify, since, until)
    return report.as_dict()


@router.get("/public-key")
async def public_key(principal: AuditorPrincipal, audit: AuditDep) -> Response:
    return Response(audit.signer.public_key_pem(), media_type="application/x-pem-file")
