"""A live gateway for the API tests: uvicorn on 127.0.0.1 in a background thread, a fresh
PostgreSQL database, tiny models, and one key per role."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from fastapi import FastAPI
from psycopg import sql

from engine.serving.service import Engine
from gateway.app import BackendLoader, create_app, load_local_backend
from gateway.backends.local import LocalBackend
from gateway.dependencies import Services
from gateway.server import GracefulServer, uvicorn_config
from gateway.settings import Settings
from tests.tiny_models import build_model, build_noisy_copy, build_pair, build_tokenizer

PG_SERVER = "postgresql://postgres@127.0.0.1:5432"


def pg_admin(statement: sql.Composed) -> None:
    """Run one statement on the server's ``test`` database (outside any transaction)."""
    with psycopg.connect(f"{PG_SERVER}/test", autocommit=True) as admin:
        admin.execute(statement)


@contextmanager
def writer_login(database: str) -> Iterator[str]:
    """A login role in the gateway's writer role (``specgate_writer``: it may append, not
    change history); yields its URL for ``database``. The role is dropped afterwards."""
    name = f"sgw_{uuid.uuid4().hex[:10]}"
    pg_admin(sql.SQL("CREATE ROLE {} LOGIN IN ROLE specgate_writer").format(sql.Identifier(name)))
    try:
        yield f"postgresql://{name}@127.0.0.1:5432/{database}"
    finally:
        pg_admin(
            sql.SQL(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = {}"
            ).format(sql.Literal(name))
        )
        pg_admin(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


@contextmanager
def fresh_database() -> Iterator[tuple[str, str]]:
    """(name, URL) of a new empty database, dropped afterwards; the gateway migrates it."""
    name = f"specgate_api_{uuid.uuid4().hex[:12]}"
    pg_admin(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield name, f"{PG_SERVER}/{name}"
    finally:
        pg_admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@dataclass
class LiveGateway:
    app: FastAPI
    base_url: str
    database: str
    keys: dict[str, str]

    @property
    def services(self) -> Services:
        services: Services = self.app.state.services
        return services

    @property
    def engine(self) -> Engine:
        """The built-in engine behind the gateway, for tests that look inside it."""
        backend = self.services.backend
        assert isinstance(backend, LocalBackend)
        return backend.engine


@contextmanager
def live_gateway(
    settings: Settings,
    database: str,
    load_backend: BackendLoader = load_local_backend,
    key_prefix: str = "test",
) -> Iterator[LiveGateway]:
    """Serve ``create_app(settings, load_backend)`` on a free port until the block ends, with
    a key per role named ``{key_prefix}-{role}`` (another prefix for a restart)."""
    app = create_app(settings, load_backend)
    listener = socket.socket()
    # Accepted sockets inherit this; without it Nagle's algorithm meets delayed ACKs and
    # every keep-alive response waits ~40 ms (uvicorn sets it only on sockets it binds).
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = GracefulServer(uvicorn_config(app, settings, log_level="warning", lifespan="on"), app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.05)
    services: Services = app.state.services
    keys = {
        role: services.keys.create(role, f"{key_prefix}-{role}", "tests")[1]
        for role in ("app", "auditor", "admin")
    }
    try:
        yield LiveGateway(app, f"http://127.0.0.1:{port}", database, keys)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        listener.close()


def gateway_settings(
    models: tuple[Path, Path], data_dir: Path, database_url: str, **extra: object
) -> Settings:
    target, draft = models
    return Settings(
        target=target,
        draft=draft,
        database_url=database_url,
        data_dir=data_dir,
        device="cpu",
        dtype="float32",
        log_format="console",
        **extra,  # type: ignore[arg-type]
    )


@contextmanager
def tiny_pair_gateway(root: Path) -> Iterator[LiveGateway]:
    """The tiny test pair (built under ``root``) served on a fresh PostgreSQL database."""
    models = build_pair(root / "models")
    with (
        fresh_database() as (name, url),
        live_gateway(gateway_settings(models, root / "data", url), name) as live,
    ):
        yield live


@contextmanager
def tools_pair_gateway(root: Path) -> Iterator[LiveGateway]:
    """A tiny pair with room for tools (built under ``root``), speculating on every request:
    the context is longer than ``build_pair``'s, since the tools' system prompt alone is ~600
    tiny tokens, and no fallback to plain decoding."""
    target = build_model(root / "target", build_tokenizer(), seed=0, max_positions=2048)
    draft = build_noisy_copy(target, root / "close", noise=0.3)
    with fresh_database() as (name, url):
        settings = gateway_settings(
            (target, draft), root / "data", url, acceptance_threshold=0.0, fallback_min_speedup=0.0
        )
        with live_gateway(settings, name) as live:
            yield live
