"""Bearer-key authentication and role checks, as FastAPI dependencies.

Roles are exclusive by design: an ``auditor`` key reads the audit log and nothing else, an
``app`` key generates and nothing else, an ``admin`` key manages keys. A key found in the
database is remembered for ``key_cache_ttl_s`` (``gateway.key_cache``): a repeat caller is
checked on the event loop, with no database call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gateway.dependencies import ServicesDep
from gateway.errors import APIError
from gateway.keys import Principal, Role

_bearer = HTTPBearer(auto_error=False)
_CHALLENGE = {"www-authenticate": "Bearer"}


async def authenticated(
    services: ServicesDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    if credentials is None:
        raise APIError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
            code="missing_api_key",
            headers=_CHALLENGE,
        )
    plaintext = credentials.credentials
    principal = services.key_cache.get(plaintext)
    if principal is not None:
        return principal
    lookup = services.key_cache.lookup()
    principal = await services.offload.db(services.keys.authenticate, plaintext)
    if principal is None:
        raise APIError(
            401, "Incorrect API key provided.", code="invalid_api_key", headers=_CHALLENGE
        )
    services.key_cache.remember(plaintext, principal, lookup)
    return principal


def require_role(role: Role) -> Callable[[Principal], Awaitable[Principal]]:
    async def check(principal: Annotated[Principal, Depends(authenticated)]) -> Principal:
        if principal.role != role:
            raise APIError(
                403,
                f"This endpoint needs a key with the '{role}' role; "
                f"this key has '{principal.role}'.",
                type="permission_error",
                code="insufficient_role",
            )
        return principal

    return check


AppPrincipal = Annotated[Principal, Depends(require_role("app"))]
AuditorPrincipal = Annotated[Principal, Depends(require_role("auditor"))]
AdminPrincipal = Annotated[Principal, Depends(require_role("admin"))]
