"""Round trips of the request path on PostgreSQL: each one is a wait on the loopback (or the
network) that every request pays, so their number is checked, not just the result."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import _connection_base

from gateway.audit.log import AuditLog
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine
from gateway.keys import KeyStore


@pytest.fixture
def commands(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every transaction-control command psycopg sends (BEGIN, COMMIT, ROLLBACK)."""
    sent: list[bytes] = []
    original = _connection_base.BaseConnection._exec_command

    def recording(self: Any, command: Any, *args: Any, **kw: Any) -> Any:
        sent.append(bytes(command) if isinstance(command, bytes) else str(command).encode())
        return original(self, command, *args, **kw)

    monkeypatch.setattr(_connection_base.BaseConnection, "_exec_command", recording)
    return sent


@pytest.fixture
def pg(pg_url: str) -> Iterator[sa.Engine]:
    engine = make_db_engine(pg_url)
    yield engine
    engine.dispose()


def test_key_lookup_sends_no_transaction_commands(
    pg: sa.Engine, tmp_path: Path, commands: list[bytes]
) -> None:
    store = KeyStore(pg, AuditLog(pg, CheckpointSigner.load_or_create(tmp_path / "s.pem")))
    principal, plaintext = store.create("app", "billing", actor="admin")
    assert store.authenticate(plaintext) == principal  # the pool now holds a connection
    commands.clear()
    assert store.authenticate(plaintext) == principal
    assert store.authenticate(plaintext + "x") is None
    assert commands == []
    store.revoke("billing", actor="admin")
    assert store.authenticate(plaintext) is None


def test_an_append_is_one_locking_read_and_its_writes(
    pg: sa.Engine, tmp_path: Path, commands: list[bytes]
) -> None:
    """BEGIN, the head row locked (its lock timeout set in the same statement), the event,
    the Merkle nodes it completes, the new head, COMMIT: nothing else reaches the server."""
    log = AuditLog(pg, CheckpointSigner.load_or_create(tmp_path / "s.pem"), lock_timeout_s=0.5)
    log.append("request", "key_a", {"i": 0})
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(" ".join(statement.split()[:3]))

    sa.event.listen(pg, "before_cursor_execute", record)
    commands.clear()
    log.append("request", "key_a", {"i": 1})  # the second leaf completes a level-1 node
    sa.event.remove(pg, "before_cursor_execute", record)
    assert statements == [
        "SELECT audit_head.id, audit_head.tree_size,",
        "INSERT INTO audit_events",
        "INSERT INTO audit_merkle_nodes",
        "UPDATE audit_head SET",
    ]
    assert commands == [b"BEGIN", b"COMMIT"]
    assert log.verify().ok


def _pooled_backend_pids(engine: sa.Engine) -> set[int]:
    with engine.connect() as connection:
        return {connection.execute(sa.select(sa.func.pg_backend_pid())).scalar_one()}


def test_a_checkout_sends_no_ping_yet_a_connection_the_server_ended_is_replaced(
    pg: sa.Engine, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No liveness query per checkout (it was one round trip per database call, three per
    request); a pooled connection the server has ended (restart, failover,
    pg_terminate_backend) is still replaced before use, so the first call after the database
    came back succeeds instead of failing."""
    store = KeyStore(pg, AuditLog(pg, CheckpointSigner.load_or_create(tmp_path / "s.pem")))
    principal, plaintext = store.create("app", "billing", actor="admin")
    (old_pid,) = _pooled_backend_pids(pg)
    statements: list[str] = []
    original = psycopg.Cursor.execute

    def recording(self: Any, query: Any, *args: Any, **kw: Any) -> Any:
        statements.append(str(query))
        return original(self, query, *args, **kw)

    monkeypatch.setattr(psycopg.Cursor, "execute", recording)
    assert store.authenticate(plaintext) == principal
    assert len(statements) == 1, statements  # the lookup itself, no ping before it
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (old_pid,))
    time.sleep(0.2)  # the server's goodbye reaches the pooled socket
    assert store.authenticate(plaintext) == principal
    assert store._audit.append("request", principal.key_id, {"after": "terminate"}).seq > 0
    monkeypatch.undo()
    assert old_pid not in _pooled_backend_pids(pg)
