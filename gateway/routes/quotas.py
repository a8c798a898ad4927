"""Teams and quotas for the ``admin`` role (``specgate teams`` and ``specgate keys quota``
do the same without the server). Every change is an audit event (`quota`, `team`, `key`)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from gateway.auth import AdminPrincipal
from gateway.dependencies import ServicesDep
from gateway.errors import APIError
from gateway.keys import KeyStoreError, Principal
from gateway.quota_schemas import (
    KeyTeamInfo,
    QuotaInfo,
    QuotaRequest,
    TeamCreateRequest,
    TeamInfo,
    TeamMembershipRequest,
)
from gateway.quotas import QuotaError, key_subject, team_subject
from gateway.request_body import CheckedBodyRoute

router = APIRouter(prefix="/v1/admin", tags=["admin"], route_class=CheckedBodyRoute)


async def _key(services: ServicesDep, key: str) -> Principal:
    active = await run_in_threadpool(services.keys.list)
    for principal in active:
        if key in (principal.key_id, principal.name):
            return principal
    raise APIError(404, f"no active key with id or name {key!r}", param="key", code="key_not_found")


async def _team(services: ServicesDep, team: str) -> str:
    if team not in await run_in_threadpool(services.quotas.store.teams):
        raise APIError(404, f"no team named {team!r}", param="team", code="team_not_found")
    return team


async def _quota(services: ServicesDep, subject: str) -> QuotaInfo:
    limits = await run_in_threadpool(services.quotas.store.limits, [subject])
    return QuotaInfo.of(subject, limits[subject])


async def _set(
    services: ServicesDep, subject: str, body: QuotaRequest, principal: Principal
) -> QuotaInfo:
    limits = body.limits()
    await run_in_threadpool(services.quotas.store.set, subject, limits, principal.key_id)
    services.quotas.forget(subject)
    return QuotaInfo.of(subject, limits)


@router.get("/keys/{key}/quota")
async def get_key_quota(key: str, principal: AdminPrincipal, services: ServicesDep) -> QuotaInfo:
    return await _quota(services, key_subject((await _key(services, key)).key_id))


@router.put("/keys/{key}/quota")
async def set_key_quota(
    key: str, body: QuotaRequest, principal: AdminPrincipal, services: ServicesDep
) -> QuotaInfo:
    """Replace a key's quota (a `quota` event); a limit left out is no limit."""
    subject = key_subject((await _key(services, key)).key_id)
    return await _set(services, subject, body, principal)


@router.put("/keys/{key}/team")
async def set_key_team(
    key: str, body: TeamMembershipRequest, principal: AdminPrincipal, services: ServicesDep
) -> KeyTeamInfo:
    """Move a key into a team, or out of any (a `key` event, action ``team``)."""
    try:
        moved = await run_in_threadpool(services.keys.set_team, key, body.team, principal.key_id)
    except KeyStoreError as error:
        raise APIError(404, str(error), param="team", code="not_found") from error
    services.key_cache.forget(key)  # the cached principal names the old team
    return KeyTeamInfo(key_id=moved.key_id, name=moved.name, team=moved.team)


@router.post("/teams", status_code=201)
async def create_team(
    body: TeamCreateRequest, principal: AdminPrincipal, services: ServicesDep
) -> TeamInfo:
    limits = body.limits()
    try:
        await run_in_threadpool(
            services.quotas.store.create_team, body.name, limits, principal.key_id
        )
    except QuotaError as error:
        raise APIError(409, str(error), param="name", code="team_exists") from error
    return TeamInfo(name=body.name, quota=QuotaInfo.of(team_subject(body.name), limits))


@router.get("/teams")
async def list_teams(principal: AdminPrincipal, services: ServicesDep) -> list[TeamInfo]:
    names = await run_in_threadpool(services.quotas.store.teams)
    subjects = [team_subject(name) for name in names]
    limits = await run_in_threadpool(services.quotas.store.limits, subjects)
    return [
        TeamInfo(name=name, quota=QuotaInfo.of(subject, limits[subject]))
        for name, subject in zip(names, subjects, strict=True)
    ]


@router.get("/teams/{team}/quota")
async def get_team_quota(team: str, principal: AdminPrincipal, services: ServicesDep) -> QuotaInfo:
    return await _quota(services, team_subject(await _team(services, team)))


@router.put("/teams/{team}/quota")
async def set_team_quota(
    team: str, body: QuotaRequest, principal: AdminPrincipal, services: ServicesDep
) -> QuotaInfo:
    """Replace a team's quota (a `quota` event); a limit left out is no limit."""
    subject = team_subject(await _team(services, team))
    return await _set(services, subject, body, principal)
