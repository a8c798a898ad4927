"""Key management for the ``admin`` role (``specgate keys`` is the main path; this mirrors it)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from gateway.auth import AdminPrincipal
from gateway.dependencies import KeysDep, ServicesDep
from gateway.errors import APIError
from gateway.keys import KeyStoreError, Principal
from gateway.request_body import CheckedBodyRoute
from gateway.schemas import CreatedKey, KeyCreateRequest, KeyInfo, KeyUpdateRequest

router = APIRouter(prefix="/v1/admin/keys", tags=["admin"], route_class=CheckedBodyRoute)


def _info(key: Principal) -> KeyInfo:
    return KeyInfo(key_id=key.key_id, name=key.name, role=key.role, store_content=key.store_content)


@router.get("")
async def list_keys(principal: AdminPrincipal, keys: KeysDep) -> list[KeyInfo]:
    active = await run_in_threadpool(keys.list)
    return [_info(key) for key in active]


@router.post("", status_code=201)
async def create_key(
    body: KeyCreateRequest, principal: AdminPrincipal, keys: KeysDep
) -> CreatedKey:
    try:
        created, plaintext = await run_in_threadpool(
            keys.create, body.role, body.name, principal.key_id, store_content=body.store_content
        )
    except KeyStoreError as error:
        raise APIError(409, str(error), param="name", code="key_exists") from error
    return CreatedKey(**_info(created).model_dump(), key=plaintext)


@router.patch("/{key}")
async def update_key(
    key: str,
    body: KeyUpdateRequest,
    principal: AdminPrincipal,
    keys: KeysDep,
    services: ServicesDep,
) -> KeyInfo:
    """Change an active key's content storage choice (``store_content``; null: the
    server's setting), audited as a `key` event."""
    try:
        updated = await run_in_threadpool(
            keys.set_store_content, key, body.store_content, principal.key_id
        )
    except KeyStoreError as error:
        raise APIError(404, str(error), param="key", code="key_not_found") from error
    # The cached principal carries the old choice: the next request reads the new one.
    services.key_cache.forget(key)
    return _info(updated)


@router.delete("/{key}")
async def revoke_key(key: str, principal: AdminPrincipal, services: ServicesDep) -> dict[str, str]:
    try:
        await run_in_threadpool(services.keys.revoke, key, principal.key_id)
    except KeyStoreError as error:
        raise APIError(404, str(error), param="key", code="key_not_found") from error
    services.key_cache.forget(key)
    return {"revoked": key}
