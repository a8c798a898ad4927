"""The request path's audit appends from the event loop: the work before the durable commit
and the way its answer reaches the request are paid by every request, twice, so what runs
there is checked (on a real PostgreSQL), not only the events written."""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import pq

from gateway.audit.log import AuditLog, AuditUnavailableError
from gateway.audit.loop_append import LoopAppender, libpq_conninfo
from gateway.audit.mac import EventMac
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine
from gateway.offload import Offload
from gateway.recording import append_durably
from gateway.spool import EventSpool

# JSON text full of what text-format arrays must quote and escape.
AWKWARD = {
    "quote": 'say "hi"',
    "backslash": "C:\\path\\to",
    "braces": "{a,b} {}",
    "text": "ünïcødé ✓, NULL, null",
    "nested": [{"k": 'v"w'}, [1, 2.5, None, True]],
}


@pytest.fixture
def pg(pg_url: str) -> Iterator[sa.Engine]:
    engine = make_db_engine(pg_url)
    yield engine
    engine.dispose()


@pytest.fixture
def offload() -> Iterator[Offload]:
    pools = Offload(db_threads=2, prepare_threads=1, timeout_s=5.0)
    yield pools
    pools.close()


def _log(pg: sa.Engine, tmp_path: Path) -> AuditLog:
    signer = CheckpointSigner.load_or_create(tmp_path / "s.pem")
    return AuditLog(pg, signer, mac=EventMac(os.urandom(32)), lock_timeout_s=0.5)


def _appender(log: AuditLog, pg: sa.Engine, offload: Offload) -> LoopAppender:
    return LoopAppender(log, offload.submit_db, libpq_conninfo(pg), {"connect_timeout": 2}, 0.5)


def test_a_loop_append_sends_every_parameter_in_binary(
    pg: sa.Engine, tmp_path: Path, offload: Offload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In text format psycopg quotes and escapes each array element through Python regular
    expressions (a payload's JSON has an escaped quote every few characters): 0.35-0.55 ms
    per append before the statement could leave. Binary parameters carry the same values:
    the payload reads back as given and the chain verifies."""
    log = _log(pg, tmp_path)
    log.append("request", "k", {"i": 0})  # the head is now known: the next goes from the loop
    # Per statement, each parameter carrying a value and the format it went in (an empty
    # array, or one of NULLs, has no element type to send in binary: it goes as ``{}`` text).
    formats: list[dict[str, pq.Format]] = []
    convert = psycopg.AsyncCursor._convert_query

    def recording(cursor: Any, query: str, params: dict[str, Any]) -> Any:
        converted = convert(cursor, query, params)
        names = re.findall(r"%\((\w+)\)", query)  # each parameter appears once, in order
        sent = dict(zip(names, converted.formats or [], strict=True))
        formats.append({name: sent[name] for name in names if _has_value(params[name])})
        return converted

    monkeypatch.setattr(psycopg.AsyncCursor, "_convert_query", recording)
    appender = _appender(log, pg, offload)

    async def run() -> list[str]:
        ids = []
        for actor in ("k", None):  # an actor, and a column of NULLs
            appended = await offload.wait_db(appender.submit("request", actor, AWKWARD), "append")
            ids.append(appended.event_id)
        await appender.close(5.0)
        return ids

    ids = asyncio.run(run())
    assert len(formats) == 2 and all("payload" in sent for sent in formats), formats
    assert {fmt for sent in formats for fmt in sent.values()} == {pq.Format.BINARY}, formats
    for event_id in ids:
        record = log.event(event_id)
        assert record is not None and record.payload == AWKWARD
    report = log.verify()
    assert report.ok and report.events_checked == 3, report


def _has_value(param: Any) -> bool:
    return not isinstance(param, list) or any(item is not None for item in param)


def test_the_completion_statement_leaves_before_the_work_done_during_its_commit(
    pg: sa.Engine, tmp_path: Path, offload: Offload
) -> None:
    """``meanwhile`` (the response rendered, the telemetry recorded) runs while the commit
    is in flight: the statement is already with the server when it starts, so it no longer
    delays the statement."""
    log = _log(pg, tmp_path)
    log.append("request", "k", {"i": 0})
    appender = _appender(log, pg, offload)
    spool = EventSpool(tmp_path / "spool", log, pg, retry_s=1.0)
    seen: list[pq.TransactionStatus] = []

    def meanwhile() -> None:
        connection = appender._connection
        assert connection is not None
        seen.append(connection.info.transaction_status)

    async def run() -> bool:
        await offload.wait_db(appender.submit("request", "k", {"i": 1}), "append")
        committed = await append_durably(
            offload, spool, appender, "completion", "k", AWKWARD, meanwhile=meanwhile
        )
        await appender.close(5.0)
        return committed

    assert asyncio.run(run()) is True
    assert seen == [pq.TransactionStatus.ACTIVE]  # sent, its answer not yet read
    assert spool.pending == 0
    assert log.verify().ok


def test_a_wait_settled_on_the_loop_needs_no_wake_up_through_its_self_pipe(
    offload: Offload,
) -> None:
    """An append from the loop settles its future on the loop's own thread: the waiting
    request resumes in the same turn, not after a write to the loop's self-pipe and another
    turn. A future settled by a pool thread still wakes the loop; a wait that gives up leaves
    the call to complete."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        woken: list[Any] = []
        threadsafe = loop.call_soon_threadsafe

        def counting(*args: Any, **kwargs: Any) -> Any:
            woken.append(args[0])
            return threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        here: Future[int] = Future()
        loop.call_soon(here.set_result, 1)
        assert await offload.wait_db(here, "on the loop") == 1
        assert woken == []
        later = offload.submit_db(lambda: time.sleep(0.05) or 2)  # settled by the thread
        assert await offload.wait_db(later, "on a thread") == 2
        assert len(woken) == 1
        failing: Future[int] = Future()
        loop.call_soon(failing.set_exception, AuditUnavailableError("refused"))
        with pytest.raises(AuditUnavailableError, match="refused"):
            await offload.wait_db(failing, "refused")
        offload.timeout_s = 0.05
        never: Future[int] = Future()
        with pytest.raises(AuditUnavailableError, match="did not answer"):
            await offload.wait_db(never, "never")
        assert not never.cancelled()
        never.set_result(3)  # completing after the wait gave up is harmless
        await asyncio.sleep(0)

    asyncio.run(run())
