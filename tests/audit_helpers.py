"""Helpers shared by the audit and key tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import sqlalchemy as sa
import typer
import uvicorn
from fastapi import FastAPI

from gateway.audit.log import AuditLog
from gateway.cli_admin import audit_app, db_app, keys_app
from gateway.errors import install_error_handlers
from gateway.key_cache import KeyCache
from gateway.keys import KeyStore
from gateway.offload import Offload
from gateway.routes import audit as audit_routes


def admin_cli() -> typer.Typer:
    """The admin command groups mounted as ``gateway.cli`` mounts them."""
    app = typer.Typer()
    app.add_typer(db_app, name="db")
    app.add_typer(keys_app, name="keys")
    app.add_typer(audit_app, name="audit")
    return app


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port until the block ends; yields its URL."""
    listener = socket.socket()
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def audit_only_app(audit: AuditLog, keys: KeyStore, db: sa.Engine) -> FastAPI:
    """The real audit routes (and error handlers) over ``audit`` (its store: ``db``), without
    the engine."""
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(audit_routes.router)
    offload = Offload(db_threads=4, prepare_threads=1, timeout_s=5.0)
    app.state.services = SimpleNamespace(
        audit=audit, db=db, keys=keys, offload=offload, key_cache=KeyCache(ttl_s=0.0)
    )
    return app
