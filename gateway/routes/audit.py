"""Audit endpoints: export, server-side verification and the public key (``auditor``); the
transparency-log endpoints a witness uses (latest checkpoint, consistency proofs, posting a
cosignature, the log's integrity status); and inclusion proofs (receipts) for the auditor or
the app key that made the request."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from gateway.audit.note import NoteError
from gateway.audit.records import b64
from gateway.audit.status import log_status
from gateway.auth import AuditorPrincipal, authenticated
from gateway.dependencies import AuditDep, ServicesDep
from gateway.errors import APIError
from gateway.keys import Principal

router = APIRouter(prefix="/v1/audit", tags=["audit"])

_MEDIA_TYPES = {"jsonl": "application/x-ndjson", "csv": "text/csv; charset=utf-8"}
NOTE_MEDIA_TYPE = "text/plain; charset=utf-8"
MAX_COSIGNED_NOTE_BYTES = 1 << 16


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
    consistency_from: Annotated[int | None, Query(ge=0)] = None,
) -> StreamingResponse:
    """The events created in [since, until), the tree around them and a signed checkpoint;
    with ``consistency_from`` also a consistency proof from that tree size.

    The first line is produced before the response starts, so that an unreachable store is
    a 503 rather than a truncated 200.
    """
    _check_range(since, until)
    try:
        lines = await run_in_threadpool(
            audit.export, since, until, format, principal.key_id, consistency_from
        )
    except ValueError as error:
        raise APIError(400, str(error), param="consistency_from") from None
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


@router.get("/checkpoint")
async def checkpoint(principal: AuditorPrincipal, audit: AuditDep) -> PlainTextResponse:
    """The latest signed checkpoint, as a C2SP tlog-checkpoint note."""
    note = await run_in_threadpool(audit.latest_checkpoint)
    return PlainTextResponse(note, media_type=NOTE_MEDIA_TYPE)


@router.get("/status")
async def status(principal: AuditorPrincipal, services: ServicesDep) -> dict[str, Any]:
    """The gateway's tamper alarm, tree size, newest checkpoint and the oldest event no
    checkpoint covers yet, on the gateway's clock (``now``): what a witness needs to tell a
    log that stopped being signed from one that is merely idle."""
    return await run_in_threadpool(log_status, services.audit, services.db)


@router.get("/consistency")
async def consistency(
    principal: AuditorPrincipal,
    audit: AuditDep,
    old_size: Annotated[int, Query(alias="from", ge=0)],
    new_size: Annotated[int, Query(alias="to", ge=0)],
) -> dict[str, Any]:
    """The RFC 9162 consistency proof from tree size ``from`` to ``to``."""
    size, _ = await run_in_threadpool(audit.head)
    if not old_size <= new_size <= size:
        raise APIError(400, f"Need from <= to <= {size} (the current tree size).", param="from")
    proof = await run_in_threadpool(audit.consistency_proof, old_size, new_size)
    return {"from": old_size, "to": new_size, "proof": [b64(h) for h in proof]}


@router.post("/cosignature")
async def cosignature(
    principal: AuditorPrincipal, audit: AuditDep, request: Request
) -> dict[str, Any]:
    """A witness hands back a checkpoint it cosigned; recorded as a ``cosignature`` event."""
    body = await request.body()
    if len(body) > MAX_COSIGNED_NOTE_BYTES:
        raise APIError(400, "The cosigned note is too large.", param="body")
    try:
        cosigned_at = await run_in_threadpool(
            audit.record_cosignature, body.decode("utf-8"), principal.key_id
        )
    except (NoteError, UnicodeDecodeError, ValueError) as error:
        raise APIError(400, f"Cosignature refused: {error}", param="body") from None
    return {"accepted": True, "cosigned_at": cosigned_at}


@router.get("/proof/{event_id}")
async def proof(
    event_id: str,
    principal: Annotated[Principal, Depends(authenticated)],
    audit: AuditDep,
) -> dict[str, Any]:
    """A receipt: the event, the latest checkpoint and the inclusion proof against it. For
    the auditor, or for the app key the event names as its actor."""
    if principal.role not in ("auditor", "app"):
        raise APIError(
            403,
            "This endpoint needs an auditor key or the app key that made the request.",
            type="permission_error",
            code="insufficient_role",
        )
    record = await run_in_threadpool(audit.event, event_id)
    if record is None or (principal.role == "app" and record.actor != principal.key_id):
        raise APIError(404, f"No audit event {event_id!r} for this key.", code="not_found")
    return await run_in_threadpool(audit.receipt, record)
