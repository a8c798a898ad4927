"""``GET /v1/admin/usage``: requests, tokens, speculation figures and errors per key, team,
model and method over time (``gateway.usage``), as JSON or CSV, for the ``admin`` role."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from gateway.auth import AdminPrincipal
from gateway.dependencies import ServicesDep
from gateway.errors import APIError
from gateway.usage import as_csv, usage

router = APIRouter(prefix="/v1/admin", tags=["admin"])


@router.get("/usage", response_model=None)
async def get_usage(
    principal: AdminPrincipal,
    services: ServicesDep,
    since: Annotated[datetime, Query(description="Requests made at or after (ISO 8601).")],
    until: Annotated[datetime | None, Query(description="... and before.")] = None,
    bucket: Literal["hour", "day"] = "hour",
    key: Annotated[str | None, Query(description="Only this key id.")] = None,
    team: Annotated[str | None, Query(description="Only this team.")] = None,
    format: Literal["json", "csv"] = "json",
) -> dict[str, Any] | PlainTextResponse:
    if since.tzinfo is None or (until is not None and until.tzinfo is None):
        raise APIError(400, "since and until need a UTC offset, e.g. +00:00.", param="since")
    rows = await run_in_threadpool(usage, services.db, since, until, bucket, key, team)
    if format == "csv":
        return PlainTextResponse(as_csv(rows), media_type="text/csv")
    return {"object": "list", "data": rows}
