"""``POST /v1/admin/audit/alarm/clear``: an ``admin`` ends a standing tamper alarm, naming the
evidence it was resolved on; the clearing is itself an audit event (``alarm_cleared``).
``specgate audit clear-alarm`` calls it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from gateway.audit.log import TamperDetectedError
from gateway.auth import AdminPrincipal
from gateway.dependencies import AuditDep, ServicesDep
from gateway.errors import APIError
from gateway.request_body import CheckedBodyRoute

router = APIRouter(prefix="/v1/admin/audit", tags=["admin"], route_class=CheckedBodyRoute)


class AlarmClearRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    evidence: str = Field(
        min_length=1,
        max_length=2000,
        description="What the alarm was resolved on (a ticket, a forensic report).",
    )
    accept_head: bool = Field(
        default=False,
        description="Accept the database's head in place of the tree this gateway wrote "
        "(after a loss that cannot be restored); the replaced tree is recorded.",
    )


@router.post("/alarm/clear")
async def clear_alarm(
    body: AlarmClearRequest, principal: AdminPrincipal, audit: AuditDep, services: ServicesDep
) -> dict[str, Any]:
    """The ``alarm_cleared`` event's payload. 409 when no alarm stands, or when the database
    still does not extend what this gateway wrote (restore the events, or accept the head)."""
    actor = f"admin:{principal.key_id}"
    try:
        return await services.offload.db(audit.clear_alarm, body.evidence, actor, body.accept_head)
    except TamperDetectedError as error:
        message = f"The alarm stands: {error.reason}. Restore the events, or accept the head."
        raise APIError(409, message, code="alarm_not_cleared") from error
    except ValueError as error:
        raise APIError(409, str(error), code="no_alarm") from error
