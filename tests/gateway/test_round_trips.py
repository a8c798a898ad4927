"""Round trips of the request path on PostgreSQL: each one is a wait on the loopback (or the
network) that every request pays, so their number is checked, not just the result."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import _connection_base

from gateway.audit.log import AppendedEvent, AuditLog
from gateway.audit.loop_append import LoopAppender, libpq_conninfo
from gateway.audit.mac import EventMac
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine
from gateway.keys import KeyStore

MAC = EventMac(b"t" * 32)


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
    store = KeyStore(pg, AuditLog(pg, CheckpointSigner.load_or_create(tmp_path / "s.pem"), MAC))
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
    """A log that does not know the head (its first append, or another writer moved it):
    BEGIN, the head row locked (its lock timeout set in the same statement), one read of the
    stored tree at the size this log wrote last (the head must still extend it: the perfect
    subtrees of that size, a leaf's event or an interior node), the event, the Merkle nodes
    it completes, the new head, COMMIT. Nothing else reaches the server."""
    log = AuditLog(pg, CheckpointSigner.load_or_create(tmp_path / "s.pem"), lock_timeout_s=0.5)
    other = AuditLog(pg, CheckpointSigner.load_or_create(tmp_path / "s.pem"))
    log.append("request", "key_a", {"i": 0})
    other.append("request", "key_b", {"i": 1})  # the head is no longer the one `log` wrote
    statements = _statements(pg)
    commands.clear()
    log.append("request", "key_a", {"i": 2})  # the third leaf completes no node
    other.append("request", "key_b", {"i": 3})  # the fourth completes two
    assert [" ".join(s.split()[:3]) for s in statements] == [
        "WITH moved AS",  # tried at the head `log` knew: nothing written
        "SELECT audit_head.id, audit_head.tree_size,",
        "SELECT audit_events.seq, audit_events.event_id,",  # the tree at size 1: its leaf
        "INSERT INTO audit_events",
        "UPDATE audit_head SET",
        "WITH moved AS",
        "SELECT audit_head.id, audit_head.tree_size,",
        "SELECT audit_merkle_nodes.level, audit_merkle_nodes.idx,",  # size 2: one node
        "INSERT INTO audit_events",
        "INSERT INTO audit_merkle_nodes",
        "UPDATE audit_head SET",
    ]
    # (BEGIN names the isolation level on a connection last used in autocommit.)
    assert [command.split()[0] for command in commands] == [b"BEGIN", b"COMMIT"] * 2
    assert log.verify().ok


def test_an_append_at_the_head_this_log_wrote_is_one_statement(
    pg: sa.Engine, tmp_path: Path, commands: list[bytes]
) -> None:
    """After its own append, a log knows the head: the next append is one statement in
    autocommit (its events, their Merkle nodes, the new head), with no BEGIN or COMMIT."""
    log = AuditLog(pg, CheckpointSigner.load_or_create(tmp_path / "s.pem"), lock_timeout_s=0.5)
    first = log.append("request", "key_a", {"i": 0})
    statements = _statements(pg)
    commands.clear()
    appended = [log.append("request", "key_a", {"i": i}) for i in range(1, 4)]
    assert [" ".join(s.split()[:3]) for s in statements] == ["WITH moved AS"] * 3
    assert commands == []
    assert [event.seq for event in appended] == [first.seq + 1, first.seq + 2, first.seq + 3]
    report = log.verify()
    assert report.ok and report.events_checked == first.seq + 3, report


def test_appends_at_a_known_head_racing_another_writer_keep_one_chain(
    pg: sa.Engine, tmp_path: Path
) -> None:
    """Two logs (two replicas) appending from four threads each: every append lands once, in
    one chain that verifies, whichever path each took."""
    signer = CheckpointSigner.load_or_create(tmp_path / "s.pem")
    logs = [AuditLog(pg, signer), AuditLog(pg, signer)]
    before = logs[0].append("request", "key_a", {"start": True}).seq
    appended: list[int] = []

    def work(log: AuditLog, worker: int) -> None:
        for i in range(10):
            appended.append(log.append("request", f"key_{worker}", {"i": i}).seq)

    threads = [
        threading.Thread(target=work, args=(log, worker)) for worker, log in enumerate(logs * 4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(appended) == list(range(before + 1, before + 81))
    report = logs[1].verify()
    assert report.ok and report.events_checked == before + 80, report


def _statements(engine: sa.Engine) -> list[str]:
    """The statements ``engine`` sends from now on."""
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        sent.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    return sent


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
    store = KeyStore(pg, AuditLog(pg, CheckpointSigner.load_or_create(tmp_path / "s.pem"), MAC))
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


def _loop_appender(log: AuditLog, pg: sa.Engine, pooled: list[str]) -> LoopAppender:
    """An appender whose hand-offs to the pool are counted in ``pooled``."""
    pool = ThreadPoolExecutor(2)

    def to_pool(fn: Any, *args: Any) -> Any:
        pooled.append(getattr(fn, "__qualname__", repr(fn)))
        return pool.submit(fn, *args)

    return LoopAppender(log, to_pool, libpq_conninfo(pg), {"connect_timeout": 2}, 0.5)


def _on_a_loop(appender: LoopAppender, events: list[dict[str, Any]]) -> list[AppendedEvent]:
    async def run() -> list[AppendedEvent]:
        appended = []
        for payload in events:
            appended.append(await asyncio.wrap_future(appender.submit("request", "k", payload)))
        await appender.close(5.0)
        return appended

    return asyncio.run(run())


def test_appends_at_a_known_head_go_from_the_event_loop_without_a_pool_thread(
    pg: sa.Engine, tmp_path: Path
) -> None:
    """Once the log knows the head, an append submitted on the event loop is its one
    statement on the loop's own connection: no pool thread, no statement through the pool's
    engine; the head it leaves is known to the pool's appends after it."""
    log = AuditLog(pg, CheckpointSigner.load_or_create(tmp_path / "s.pem"), lock_timeout_s=0.5)
    first = log.append("request", "k", {"i": 0})
    pooled: list[str] = []
    appender = _loop_appender(log, pg, pooled)
    statements = _statements(pg)
    appended = _on_a_loop(appender, [{"i": i} for i in range(1, 4)])
    assert pooled == [] and statements == []
    assert [event.seq for event in appended] == [first.seq + 1, first.seq + 2, first.seq + 3]
    assert log.append("request", "k", {"i": 4}).seq == first.seq + 4
    assert [" ".join(s.split()[:3]) for s in statements] == ["WITH moved AS"]
    report = log.verify()
    assert report.ok and report.events_checked == first.seq + 4, report


def test_a_loop_append_after_another_writer_moved_the_head_goes_to_the_pool(
    pg: sa.Engine, tmp_path: Path
) -> None:
    signer = CheckpointSigner.load_or_create(tmp_path / "s.pem")
    log, other = AuditLog(pg, signer, lock_timeout_s=0.5), AuditLog(pg, signer)
    log.append("request", "k", {"i": 0})
    moved = other.append("request", "other", {"i": 1})
    pooled: list[str] = []
    (appended,) = _on_a_loop(_loop_appender(log, pg, pooled), [{"i": 2}])
    assert appended.seq == moved.seq + 1
    assert len(pooled) == 1  # tried at the old head, nothing written, then under the lock
    report = other.verify()
    assert report.ok and report.events_checked == moved.seq + 1, report


def test_a_loop_connection_the_server_ended_is_replaced_before_the_append(
    pg: sa.Engine, pg_url: str, tmp_path: Path
) -> None:
    log = AuditLog(pg, CheckpointSigner.load_or_create(tmp_path / "s.pem"), lock_timeout_s=0.5)
    log.append("request", "k", {"i": 0})
    pooled: list[str] = []
    appender = _loop_appender(log, pg, pooled)

    async def run() -> list[int]:
        seqs = [(await asyncio.wrap_future(appender.submit("request", "k", {"i": 1}))).seq]
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE pid <> pg_backend_pid() AND datname = current_database() "
                "AND query LIKE '%%WITH moved AS%%'"
            )
        await asyncio.sleep(0.2)  # the server's goodbye reaches the loop's socket
        seqs.append((await asyncio.wrap_future(appender.submit("request", "k", {"i": 2}))).seq)
        await appender.close(5.0)
        return seqs

    first, second = asyncio.run(run())
    assert second == first + 1 and pooled == []
    assert log.verify().ok
