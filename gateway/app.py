"""The gateway application: ``create_app(settings)`` wires settings, audit log, keys and backends.

Startup order matters for fail-closed auditing: the audit store is migrated and reachable,
events spooled by the previous run are committed, the models are loaded, this instance's lease
is taken with its previous run's unanswered requests marked `interrupted` (and those of other
instances whose lease expired: ``gateway.leases``), and the `startup` event is committed
before the first request can be served.
The caller binds the port before the app starts (``gateway.server``), so a start that cannot
listen writes no `startup` event. Shutdown writes a `shutdown` event and a final checkpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import structlog
from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from engine.api.types import FallbackEvent
from gateway import openapi
from gateway.admission import Admission
from gateway.audit.log import AuditUnavailableError, WitnessPolicy
from gateway.audit.loop_append import LoopAppender, libpq_conninfo
from gateway.audit.mac import EventMac
from gateway.audit.signing import CheckpointSigner, load_public_key
from gateway.audit.sweep import slice_size, tick_seconds
from gateway.backends.base import GenerationBackend, ReplicatedBackend
from gateway.backends.local import LocalBackend
from gateway.body_limit import BodySizeLimitMiddleware
from gateway.console import router as console_router
from gateway.db import (
    DatabaseTimeouts,
    is_sqlite,
    make_db_engine,
    normalise_url,
    upgrade_database,
)
from gateway.dependencies import Services
from gateway.errors import install_error_handlers
from gateway.interpreter import tuned_for_serving
from gateway.key_cache import KeyCache
from gateway.keys import KeyStore, KeyStoreError
from gateway.leases import Leases
from gateway.lifecycle import Lifecycle
from gateway.notes import DEMO_DRAFT_MISSING, demo_draft_missing
from gateway.observability.audit import ObservedAuditLog
from gateway.observability.drift import AcceptanceWatch, load_expectations
from gateway.observability.telemetry import Telemetry
from gateway.offload import Offload
from gateway.privacy.kek import KeyEncryptionKey
from gateway.privacy.processing_record import record_at_startup
from gateway.privacy.store import PrivacyStore
from gateway.quota_gate import QuotaGate
from gateway.quota_windows import QuotaWindows
from gateway.quotas import QuotaStore
from gateway.rate_limit_headers import RateLimitHeaders
from gateway.recording import (
    append_durably,
    drift_recorder,
    fallback_recorder,
    replica_recorder,
    startup_payload,
)
from gateway.recovery import instance_id
from gateway.refusals import RefusalLog
from gateway.routes import (
    admin,
    audit,
    audit_alarm,
    completions,
    health,
    models,
    responses,
    tokenize,
)
from gateway.routes import privacy as privacy_routes
from gateway.routes import quotas as quota_routes
from gateway.routes import usage as usage_routes
from gateway.served_models import load_models
from gateway.settings import ConfigError, Settings, engine_config
from gateway.spool import EventSpool
from gateway.tune.watch import LiveDrift

log = structlog.get_logger(__name__)

SYSTEM_ACTOR = "specgate"
BOOTSTRAP_KEY_NAME = "bootstrap-admin"


def _bootstrap_admin(settings: Settings, keys: KeyStore) -> None:
    """Store the configured admin key (Helm's first-start path) unless it exists already."""
    if settings.bootstrap_admin_key is None:
        return
    plaintext = settings.bootstrap_admin_key.get_secret_value()
    if keys.authenticate(plaintext) is not None:
        return
    try:
        keys.create("admin", BOOTSTRAP_KEY_NAME, SYSTEM_ACTOR, plaintext=plaintext)
    except KeyStoreError as error:
        raise ConfigError(
            f"bootstrap_admin_key: cannot store it ({error}); revoke the old "
            f"'{BOOTSTRAP_KEY_NAME}' key with `specgate keys revoke {BOOTSTRAP_KEY_NAME}`"
        ) from error


def _witness_policy(settings: Settings) -> WitnessPolicy | None:
    if settings.witness_public_key_path is None:
        return None
    try:
        key = load_public_key(settings.witness_public_key_path.read_bytes())
    except (OSError, ValueError) as error:
        raise ConfigError(f"witness_public_key_path: {error}") from None
    return WitnessPolicy(key, settings.witness_name, settings.witness_max_age_s)


def database_timeouts(settings: Settings) -> DatabaseTimeouts:
    return DatabaseTimeouts(
        connect_s=settings.db_connect_timeout_s,
        statement_s=settings.db_statement_timeout_s,
        lock_s=settings.db_lock_timeout_s,
    )


FallbackListener = Callable[[FallbackEvent], None]
# What the app serves a model from: built from that model's settings, given the fallback
# listener (audit and metrics) the backend calls on each switch.
BackendLoader = Callable[[Settings, FallbackListener], GenerationBackend]


def load_local_backend(settings: Settings, on_fallback: FallbackListener) -> GenerationBackend:
    """The built-in engine, loaded from the model directories the settings name."""
    config = engine_config(settings)
    if demo_draft_missing(settings, config.draft):
        log.warning("demo_draft_missing", hint=DEMO_DRAFT_MISSING)
    return LocalBackend.load(config, on_fallback=on_fallback)


def load_configured_backend(settings: Settings, on_fallback: FallbackListener) -> GenerationBackend:
    """The backend a model's settings' ``backend.kind`` names."""
    if settings.backend.kind == "vllm":
        from gateway.backends.vllm import load_vllm_backend

        return load_vllm_backend(settings, on_fallback)
    return load_local_backend(settings, on_fallback)


def start_services(
    settings: Settings,
    telemetry: Telemetry,
    load_backend: BackendLoader = load_configured_backend,
) -> Services:
    """Migrate, open the audit log, commit what the last run spooled, mark what it left
    unanswered, load the models and record the `startup` event."""
    url = normalise_url(settings.database_url)
    if settings.migrate or url.startswith("sqlite"):
        upgrade_database(url)
    db = make_db_engine(url, database_timeouts(settings))
    signer = CheckpointSigner.load_or_create(settings.signing_key_path, settings.audit_origin)
    audit_log = ObservedAuditLog(
        db,
        signer,
        telemetry,
        mac=EventMac.load_or_create(settings.audit_mac_key_path),
        state_path=settings.audit_state_path,
        lock_timeout_s=settings.audit_lock_timeout_s,
        witness=_witness_policy(settings),
    )
    keys = KeyStore(db, audit_log)
    privacy = PrivacyStore(
        db, KeyEncryptionKey.load_or_create(settings.privacy_kek_path), audit_log
    )
    instance = instance_id(settings.data_dir, settings.instance_id)
    spool = EventSpool(settings.data_dir, audit_log, db, settings.spool_retry_s)
    spool.drain()
    record_at_startup(settings.processing_record_path, audit_log, db, SYSTEM_ACTOR)
    expectations = load_expectations(settings.tune_report)
    on_fallback = telemetry.fallback_listener(fallback_recorder(spool))
    served = load_models(settings.configured_models(), lambda own: load_backend(own, on_fallback))
    telemetry.watch_backends([model.backend for model in served])
    for model in served:
        backend = model.backend
        if isinstance(backend, ReplicatedBackend):
            telemetry.metrics.watch_replicas(backend.replica_states)
            backend.watch_replicas(telemetry.replica_listener(replica_recorder(spool)))
    leases = Leases(audit_log, db, instance, settings.lease_ttl_s)
    try:
        # After the (slow) model load, so that the lease is fresh when serving starts.
        interrupted = leases.take()
        if interrupted:
            log.warning("requests_interrupted", count=interrupted)
        _mark_expired(leases)
        _seal_key_rows(keys)
        _bootstrap_admin(settings, keys)
        audit_log.append(
            "startup",
            SYSTEM_ACTOR,
            {**startup_payload(settings, served), "instance_id": instance},
        )
    except BaseException:
        served.close()
        db.dispose()
        raise
    spool.start()
    refusals = RefusalLog(
        spool,
        model=", ".join(served.names),
        instance_id=instance,
        window_s=settings.refusal_window_s,
    )
    refusals.start()
    offload = Offload(
        db_threads=settings.db_threads,
        prepare_threads=settings.prepare_threads,
        timeout_s=settings.audit_timeout_s,
    )
    record_drift = drift_recorder(spool, instance)
    acceptance = AcceptanceWatch(
        LiveDrift(
            expectations,
            settings.drift_window_tokens,
            settings.drift_margin,
            settings.drift_floor,
        ),
        telemetry.metrics,
        {model.backend.card.model_name: model.backend.speculation_speedup for model in served},
        lambda drift: offload.submit_io(record_drift, drift),
    )
    return Services(
        settings=settings,
        models=served,
        audit=audit_log,
        keys=keys,
        signer=signer,
        db=db,
        telemetry=telemetry,
        offload=offload,
        appender=LoopAppender(
            audit_log,
            lambda fn, *args: offload.submit_db(fn, *args),
            None if is_sqlite(db) else libpq_conninfo(db),
            database_timeouts(settings).connect_args(),
            settings.audit_lock_timeout_s,
        ),
        spool=spool,
        admission=Admission(settings.max_queue),
        lifecycle=Lifecycle(settings.shutdown_grace_s, records_s=settings.audit_timeout_s),
        instance_id=instance,
        refusals=refusals,
        privacy=privacy,
        key_cache=KeyCache(settings.key_cache_ttl_s),
        leases=leases,
        quotas=QuotaGate(
            QuotaStore(db, audit_log), QuotaWindows(db), offload, settings.key_cache_ttl_s
        ),
        acceptance=acceptance,
    )


def _seal_key_rows(keys: KeyStore) -> None:
    """Give the key rows from before row MACs theirs (``gateway.key_rows``)."""
    sealed = keys.seal_unsealed(SYSTEM_ACTOR)
    if sealed:
        log.info("key_rows_sealed", count=len(sealed), key_ids=sealed)


def _mark_expired(leases: Leases) -> None:
    for instance, count in leases.mark_expired().items():
        log.warning("expired_instance_interrupted", instance_id=instance, count=count)


async def stop_services(services: Services) -> None:
    """Record the `shutdown` event (spooled if the store is away) and a final signed
    checkpoint, then stop the backend and the writers; every wait on the database ends with
    the shutdown's grace period (``audit_timeout_s`` each without one)."""
    settings = services.settings

    def time_left() -> float:
        return services.lifecycle.time_left(otherwise=settings.audit_timeout_s)

    await run_in_threadpool(services.refusals.close)
    try:
        await append_durably(
            services.offload,
            services.spool,
            services.appender,
            "shutdown",
            SYSTEM_ACTOR,
            {"instance_id": services.instance_id, "pending_spooled": services.spool.pending},
        )
        await services.offload.db(services.audit.checkpoint)
    except AuditUnavailableError as error:
        log.error("shutdown_not_checkpointed", error=str(error))
    if services.spool.pending == 0 and services.lifecycle.running == 0:
        # Every request answered and recorded: nothing for other instances to mark.
        try:
            await services.offload.db(services.leases.release)
        except AuditUnavailableError as error:
            log.warning("lease_not_released", error=str(error))
    await services.appender.close(time_left())
    await run_in_threadpool(services.models.close)
    await run_in_threadpool(services.spool.close, time_left())
    services.offload.close()
    services.db.dispose()


async def _sign_checkpoints(services: Services, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await services.offload.db(services.audit.checkpoint)
        except AuditUnavailableError as error:
            log.warning("checkpoint_not_signed", error=str(error))


async def _watch_head(services: Services, interval_s: float) -> None:
    """Check every ``interval_s`` that the database still extends what this gateway wrote
    and verified (``AuditLog.watch``)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await services.offload.db(services.audit.watch)
        except AuditUnavailableError as error:
            log.warning("audit_head_not_watched", error=str(error))


async def _reverify_history(services: Services, period_s: float) -> None:
    """Verify the whole signed history again within every ``period_s``, a slice a tick
    (``gateway.audit.sweep``)."""
    tick_s = tick_seconds(period_s)
    while True:
        await asyncio.sleep(tick_s)
        signed = services.audit.signed_state.frontier.size
        try:
            await services.offload.db(services.audit.reverify, slice_size(signed, tick_s, period_s))
        except AuditUnavailableError as error:
            log.warning("history_not_reverified", error=str(error))


async def _keep_lease(services: Services, interval_s: float) -> None:
    """Renew this instance's lease and mark the requests of instances whose lease expired."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await services.offload.db(services.leases.renew)
            await services.offload.db(_mark_expired, services.leases)
        except AuditUnavailableError as error:
            log.warning("lease_not_renewed", error=str(error))


async def _expire_content(services: Services, interval_s: float) -> None:
    """Retention: destroy the content keys older than ``retention_days``, now and then."""
    while True:
        try:
            destroyed = await services.offload.db(
                services.privacy.expire, services.settings.retention_days, SYSTEM_ACTOR
            )
            if destroyed:
                log.info("content_keys_expired", count=len(destroyed))
        except AuditUnavailableError as error:
            log.warning("retention_not_applied", error=str(error))
        await asyncio.sleep(interval_s)


def create_app(
    settings: Settings, load_backend: BackendLoader = load_configured_backend
) -> FastAPI:
    # The egress guard runs first: a refused telemetry endpoint stops startup here.
    telemetry = Telemetry.start(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = await run_in_threadpool(start_services, settings, telemetry, load_backend)
        app.state.services = services
        app.state.started_at = int(time.time())
        checkpoints = asyncio.create_task(
            _sign_checkpoints(services, settings.checkpoint_interval_s)
        )
        retention = asyncio.create_task(_expire_content(services, settings.retention_interval_s))
        reverify = asyncio.create_task(
            _reverify_history(services, settings.audit_reverify_period_s)
        )
        watch = asyncio.create_task(_watch_head(services, settings.audit_watch_interval_s))
        lease = asyncio.create_task(_keep_lease(services, settings.lease_renew_s))
        log.info(
            "gateway_started",
            models=services.models.names,
            host=settings.host,
            port=settings.port,
        )
        if not await services.offload.db(services.keys.list):
            log.warning(
                "no_api_keys",
                hint="create one with: specgate keys create --role app --name NAME",
            )
        try:
            with tuned_for_serving(settings.gil_switch_interval_s):
                yield
        finally:
            checkpoints.cancel()
            retention.cancel()
            reverify.cancel()
            watch.cancel()
            lease.cancel()
            app.state.services = None
            await stop_services(services)
            telemetry.shutdown()

    # No /docs or /redoc: their pages load scripts from a public CDN.
    app = FastAPI(
        title="Specgate", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.services = None
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_body_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
    )
    app.add_middleware(RateLimitHeaders)
    telemetry.instrument(app)
    install_error_handlers(app)
    for module in (
        completions,
        responses,
        models,
        tokenize,
        audit,
        audit_alarm,
        privacy_routes,
        admin,
        quota_routes,
        usage_routes,
        health,
    ):
        app.include_router(module.router)
    app.include_router(console_router)
    openapi.install(app)
    return app
