"""What the routes are given: the services the app holds in ``app.state.services``.

Routes declare what they need with the ``Annotated`` aliases below (FastAPI's dependency
style), so that a route never reaches into ``app.state`` itself. The dependencies are
``async`` although they never wait: FastAPI runs a plain ``def`` dependency on anyio's
shared thread pool, a thread hop each way on every request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import sqlalchemy as sa
from fastapi import Depends, Request

from gateway.admission import Admission
from gateway.audit.log import AuditLog
from gateway.audit.loop_append import LoopAppender
from gateway.audit.signing import CheckpointSigner
from gateway.backends.base import GenerationBackend
from gateway.errors import APIError
from gateway.key_cache import KeyCache
from gateway.keys import KeyStore
from gateway.leases import Leases
from gateway.lifecycle import Lifecycle
from gateway.observability.drift import AcceptanceWatch
from gateway.observability.telemetry import Telemetry
from gateway.offload import Offload
from gateway.privacy.store import PrivacyStore
from gateway.quota_gate import QuotaGate
from gateway.refusals import RefusalLog
from gateway.served_models import ServedModels
from gateway.settings import Settings
from gateway.spool import EventSpool


@dataclass
class Services:
    settings: Settings
    models: ServedModels
    audit: AuditLog
    keys: KeyStore
    signer: CheckpointSigner
    db: sa.Engine
    telemetry: Telemetry
    offload: Offload
    appender: LoopAppender
    spool: EventSpool
    admission: Admission
    lifecycle: Lifecycle
    instance_id: str
    refusals: RefusalLog
    privacy: PrivacyStore
    key_cache: KeyCache
    leases: Leases
    quotas: QuotaGate
    acceptance: AcceptanceWatch

    @property
    def backend(self) -> GenerationBackend:
        """The first model's backend: the one model of a single-model configuration."""
        return self.models.first.backend


def services_of(request: Request) -> Services:
    """The app's services; 503 ``not_ready`` while it starts or stops."""
    services: Services | None = request.app.state.services
    if services is None:
        raise APIError(
            503,
            "The gateway is starting or stopping.",
            type="service_unavailable",
            code="not_ready",
        )
    return services


async def get_services(request: Request) -> Services:
    return services_of(request)


async def get_audit(request: Request) -> AuditLog:
    return services_of(request).audit


async def get_keys(request: Request) -> KeyStore:
    return services_of(request).keys


async def get_settings(request: Request) -> Settings:
    return services_of(request).settings


ServicesDep = Annotated[Services, Depends(get_services)]
AuditDep = Annotated[AuditLog, Depends(get_audit)]
KeysDep = Annotated[KeyStore, Depends(get_keys)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
