"""Faults: a PostgreSQL server that stalls (SIGSTOP) or stops, a gateway killed with SIGKILL,
a gateway told to stop (SIGTERM) with streams in flight. Each must end in bounded answers and
a complete, verifying audit log.

The stall and outage tests run their own PostgreSQL on a free port (data directory under the
test's tmp path). Bounds are stated with their margins for a busy 2-core machine.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from engine.api.types import FallbackEvent
from gateway.audit.log import AppendedEvent, AuditLog, AuditUnavailableError
from gateway.audit.loop_append import LoopAppender, libpq_conninfo
from gateway.audit.mac import EventMac
from gateway.audit.schema import audit_events
from gateway.audit.signing import CheckpointSigner, load_or_create_private_key, public_key_pem
from gateway.db import DatabaseTimeouts, make_db_engine, upgrade_database
from gateway.keys import KeyStore
from gateway.offload import Offload
from gateway.recording import fallback_recorder
from gateway.spool import EventSpool
from tests.api_harness import LiveGateway, fresh_database
from tests.pg_instance import (
    AUDIT_TIMEOUT_S,
    PgInstance,
    free_port,
    gateway_on,
    running_instance,
)
from tests.stream_reader import Stream, wait_until
from tests.tiny_models import build_pair

MODEL = "target"
# A 503 must come within the audit bound plus the connect timeout's worth of slack.
ANSWER_BOUND_S = AUDIT_TIMEOUT_S + 3.0
# /readyz's one bound for all its database checks, and the slack for the HTTP round trip and
# the event loop's turns on a busy 2-core machine.
READY_TIMEOUT_S = 3.0
READY_SLACK_S = 1.0
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
LONG = {**CHAT, "max_tokens": 300, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("fault-models"))


@pytest.fixture(scope="module")
def own_pg() -> Iterator[PgInstance]:
    with running_instance() as instance:
        yield instance


@pytest.fixture(scope="module")
def gateway(
    own_pg: PgInstance, models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveGateway]:
    with gateway_on(own_pg, models, tmp_path_factory, "faults") as live:
        yield live


def _headers(gateway: LiveGateway, role: str = "app") -> dict[str, str]:
    return {"authorization": f"Bearer {gateway.keys[role]}"}


def _events(db: sa.Engine, kind: str) -> list[sa.Row[Any]]:
    with db.connect() as connection:
        query = sa.select(audit_events).where(audit_events.c.kind == kind)
        return list(connection.execute(query.order_by(audit_events.c.seq)))


def _verify(gateway: LiveGateway) -> None:
    report = httpx.get(
        gateway.base_url + "/v1/audit/verify", headers=_headers(gateway, "auditor"), timeout=60
    ).json()
    assert report["ok"] is True, report


def test_stalled_database_gives_bounded_503s_while_the_engine_keeps_decoding(
    gateway: LiveGateway, own_pg: PgInstance
) -> None:
    services = gateway.services
    streams = [Stream(gateway.base_url, _headers(gateway), LONG) for _ in range(4)]
    for stream in streams:
        assert stream.first_chunk.wait(60)
    own_pg.pause()
    paused_at = time.monotonic()
    try:
        answers: list[tuple[int, float, str | None]] = []

        def ask() -> None:
            started = time.monotonic()
            response = httpx.post(
                gateway.base_url + "/v1/chat/completions",
                json=CHAT,
                headers=_headers(gateway),
                timeout=60,
            )
            code = response.json()["error"]["code"] if response.status_code != 200 else None
            answers.append((response.status_code, time.monotonic() - started, code))

        askers = [threading.Thread(target=ask) for _ in range(3)]
        for asker in askers:
            asker.start()
        started = time.monotonic()
        ready = httpx.get(gateway.base_url + "/readyz", timeout=60)
        ready_s = time.monotonic() - started
        for asker in askers:
            asker.join(60)
        assert ready.status_code == 503 and ready_s < ANSWER_BOUND_S, (ready, ready_s)
        assert len(answers) == 3
        for status, seconds, code in answers:
            assert status == 503 and code == "audit_unavailable", answers
            assert seconds < ANSWER_BOUND_S, answers
        # The in-flight streams are decoded to the end during the stall; their completion
        # events go to the spool, so each stream still ends with [DONE].
        for stream in streams:
            assert stream.ended.wait(60)
            assert stream.done, stream.chunks[-1:]
        assert all(stream.ended_at - paused_at < 30 for stream in streams)
        assert services.spool.pending >= len(streams)
    finally:
        own_pg.resume()
    wait_until(lambda: services.spool.pending == 0, 60, "the spool to drain")
    completions = _events(services.db, "completion")
    for stream in streams:
        mine = [c for c in completions if c.payload["request_event_id"] == stream.audit_id]
        assert len(mine) == 1, mine
        assert mine[0].payload["outcome"] == "ok"
    # Every request event written (also those answered 503 that committed late) has exactly
    # one completion.
    requests = {r.event_id for r in _events(services.db, "request")}
    answered = [c.payload["request_event_id"] for c in completions]
    assert sorted(answered) == sorted(set(answered))
    assert requests == set(answered)
    assert httpx.get(gateway.base_url + "/readyz", timeout=30).status_code == 200
    _verify(gateway)


def test_readyz_answers_503_within_one_audit_bound_in_a_stall(
    own_pg: PgInstance, models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """/readyz pings the store and, with a witness age bound, reads the newest cosignature:
    two database calls, which a stall holds both; the whole check answers within one
    ``audit_timeout_s``."""
    witness = tmp_path_factory.mktemp("readyz-witness")
    key = load_or_create_private_key(witness / "witness-key.pem")
    (witness / "witness.pem").write_bytes(public_key_pem(key.public_key()))
    with gateway_on(
        own_pg,
        models,
        tmp_path_factory,
        "readyz",
        audit_timeout_s=READY_TIMEOUT_S,
        witness_public_key_path=witness / "witness.pem",
        witness_max_age_s=600.0,
    ) as live:
        httpx.get(live.base_url + "/readyz", timeout=30)  # the pool's connections are open
        own_pg.pause()
        try:
            started = time.monotonic()
            ready = httpx.get(live.base_url + "/readyz", timeout=60)
            ready_s = time.monotonic() - started
        finally:
            own_pg.resume()
    assert ready.status_code == 503, ready.text
    assert ready.json()["checks"]["audit_store"] is False
    assert ready_s < READY_TIMEOUT_S + READY_SLACK_S, ready_s


def test_completions_and_fallbacks_during_an_outage_are_spooled_and_committed_in_order(
    gateway: LiveGateway, own_pg: PgInstance
) -> None:
    services = gateway.services
    streams = [Stream(gateway.base_url, _headers(gateway), LONG) for _ in range(2)]
    for stream in streams:
        assert stream.first_chunk.wait(60)
    own_pg.stop()
    try:
        started = time.monotonic()
        record = fallback_recorder(services.spool)
        record(
            FallbackEvent(
                method="draft",
                model=MODEL,
                action="disabled",
                reason="test outage",
                acceptance_rate=0.1,
                window_tokens=64,
                threshold=0.6,
            )
        )
        assert time.monotonic() - started < 0.5  # the engine's thread never waits on the store
        for stream in streams:
            assert stream.ended.wait(60)
            assert stream.done
        assert services.spool.pending >= 3
        time.sleep(1.0)  # a measurable delay
    finally:
        own_pg.start()
    wait_until(lambda: services.spool.pending == 0, 60, "the spool to drain")
    completions = _events(services.db, "completion")
    ids = {stream.audit_id for stream in streams}
    spooled = [
        c for c in completions if "spool" in c.payload and c.payload["request_event_id"] in ids
    ]
    assert {c.payload["request_event_id"] for c in spooled} == ids
    assert all(c.payload["spool"]["delay_s"] >= 1.0 for c in spooled)
    fallback = [f for f in _events(services.db, "fallback") if f.payload["reason"] == "test outage"]
    assert len(fallback) == 1 and fallback[0].payload["spool"]["delay_s"] >= 1.0
    seqs = [c.seq for c in spooled] + [fallback[0].seq]
    spooled_at = [c.payload["spool"]["spooled_at"] for c in spooled] + [
        fallback[0].payload["spool"]["spooled_at"]
    ]
    assert [s for _, s in sorted(zip(spooled_at, seqs, strict=True))] == sorted(seqs)
    _verify(gateway)


def test_a_completion_that_cannot_be_recorded_ends_the_stream_with_an_error_saying_so(
    gateway: LiveGateway, own_pg: PgInstance, tmp_path: Path
) -> None:
    services = gateway.services
    spool_path = services.spool.path
    stream = Stream(gateway.base_url, _headers(gateway), LONG)
    assert stream.first_chunk.wait(60)
    own_pg.stop()
    unwritable = tmp_path / "not-a-file"
    unwritable.mkdir()  # opening a directory for appending fails, even for root
    services.spool.path = unwritable
    try:
        assert stream.ended.wait(60)
    finally:
        services.spool.path = spool_path
        own_pg.start()
    assert not stream.done
    assert stream.error is not None and stream.error["code"] == "completion_not_recorded"
    assert (
        "not recorded" in stream.error["message"]
        or "could not be recorded" in (stream.error["message"])
    )
    # The text it streamed is the client's; the log shows a request without a completion,
    # which the next restart of this instance marks `interrupted`.
    completions = _events(services.db, "completion")
    assert stream.audit_id not in {c.payload["request_event_id"] for c in completions}
    _verify(gateway)


def test_a_spool_left_by_a_crash_commits_each_event_once(pg_url: str, tmp_path: Path) -> None:
    db = make_db_engine(pg_url)
    audit = AuditLog(db)
    first = EventSpool(tmp_path, audit, db, retry_s=0.1)
    first.enqueue("fallback", None, {"reason": "committed before the crash"})
    first.enqueue("fallback", None, {"reason": "never committed"})
    # The first was committed, then the process died before marking it done.
    with first.path.open(encoding="utf-8") as lines:
        entries = [json.loads(line) for line in lines]
    audit.append(
        "fallback",
        None,
        {
            **entries[0]["payload"],
            "spool": {"id": entries[0]["id"], "spooled_at": entries[0]["spooled_at"]},
        },
    )
    second = EventSpool(tmp_path, audit, db, retry_s=0.1)
    assert second.pending == 2
    second.drain()
    reasons = [row.payload["reason"] for row in _events(db, "fallback")]
    assert reasons == ["committed before the crash", "never committed"]
    assert EventSpool(tmp_path, audit, db, retry_s=0.1).pending == 0
    db.dispose()


# --- the process: kill -9, failed start, SIGTERM -------------------------------------------


def test_a_loop_append_answers_in_bounded_time_while_the_server_is_stalled_or_stopped(
    own_pg: PgInstance, tmp_path: Path
) -> None:
    """The `request` and `completion` appends go from the event loop on a connection of its
    own (``gateway.audit.loop_append``). Stalled (SIGSTOP) under a statement: the wait gives
    up within the audit bound, and the statement commits once the server runs again.
    Stopped: the append fails within the bound. Started again: appends resume on a new
    connection; one chain, verifying."""
    url = own_pg.create_database("loop_append")
    upgrade_database(url)
    timeouts = DatabaseTimeouts(connect_s=2.0, statement_s=2.0, lock_s=2.0)
    db = make_db_engine(url, timeouts)
    log = AuditLog(db, CheckpointSigner.load_or_create(tmp_path / "s.pem"), lock_timeout_s=2.0)
    offload = Offload(db_threads=4, prepare_threads=1, timeout_s=AUDIT_TIMEOUT_S)
    appender = LoopAppender(
        log, offload.submit_db, libpq_conninfo(db), timeouts.connect_args(), 2.0
    )
    log.append("request", "k", {"i": 0})  # the head is known from here on

    async def append(payload: dict[str, Any]) -> AppendedEvent:
        return await offload.wait_db(appender.submit("request", "k", payload), "request append")

    async def bounded_failure(payload: dict[str, Any]) -> float:
        started = time.monotonic()
        with pytest.raises(AuditUnavailableError):
            await append(payload)
        return time.monotonic() - started

    async def run() -> tuple[float, AppendedEvent, float, AppendedEvent]:
        before = await append({"i": 1})  # the loop's connection is open
        own_pg.pause()
        try:
            stalled = appender.submit("request", "k", {"i": 2})
            started = time.monotonic()
            with pytest.raises(AuditUnavailableError):
                await offload.wait_db(stalled, "request append")
            stalled_s = time.monotonic() - started
        finally:
            own_pg.resume()
        late = await asyncio.wrap_future(stalled)
        assert late.seq == before.seq + 1
        own_pg.stop()
        try:
            stopped_s = await bounded_failure({"i": 3})
        finally:
            own_pg.start()
        after = await append({"i": 4})
        await appender.close(5.0)
        return stalled_s, late, stopped_s, after

    stalled_s, late, stopped_s, after = asyncio.run(run())
    offload.close()
    assert stalled_s < ANSWER_BOUND_S and stopped_s < ANSWER_BOUND_S, (stalled_s, stopped_s)
    assert after.seq == late.seq + 1
    report = log.verify()
    assert report.ok and report.events_checked == after.seq, report
    db.dispose()


def _serve(
    models: tuple[Path, Path], data: Path, url: str, port: int, **env: str
) -> subprocess.Popen[bytes]:
    target, draft = models
    environment = {
        **os.environ,
        "SPECGATE_TARGET": str(target),
        "SPECGATE_DRAFT": str(draft),
        "SPECGATE_DEVICE": "cpu",
        "SPECGATE_DTYPE": "float32",
        "SPECGATE_DATA_DIR": str(data),
        "SPECGATE_DATABASE_URL": url,
        "SPECGATE_PORT": str(port),
        "SPECGATE_LOG_LEVEL": "warning",
        **env,
    }
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "specgate"), "serve"],
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait_ready(port: int, process: subprocess.Popen[bytes]) -> None:
    def ready() -> bool:
        assert process.poll() is None, (process.stderr.read() if process.stderr else b"")[-4000:]
        try:
            return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, 120, "the gateway to be ready")


def _app_key(url: str, data: Path) -> str:
    """An app key whose `key_created` event carries the MAC of the gateway serving ``data``
    (without it the gateway's own check rightly reports the event as forged)."""
    db = make_db_engine(url)
    try:
        audit = AuditLog(db, mac=EventMac.from_file(data / "audit-mac-key"))
        return KeyStore(db, audit).create("app", f"app-{time.monotonic_ns()}", "tests")[1]
    finally:
        db.dispose()


def test_kill_9_then_restart_marks_the_interrupted_requests(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    with fresh_database() as (_, url):
        upgrade_database(url)
        port = free_port()
        # One sequence at a time, none ending early: some are still queued at the kill on
        # any machine.
        process = _serve(models, tmp_path / "data", url, port, SPECGATE_MAX_NUM_SEQS="1")
        try:
            _wait_ready(port, process)
            headers = {"authorization": f"Bearer {_app_key(url, tmp_path / 'data')}"}
            body = {**LONG, "min_tokens": LONG["max_tokens"]}
            streams = [Stream(f"http://127.0.0.1:{port}", headers, body) for _ in range(6)]
            assert streams[0].first_chunk.wait(60)
            wait_until(lambda: all(s.audit_id for s in streams), 30, "every request event")
            process.kill()
            process.wait(30)
        finally:
            process.kill()
        for stream in streams:
            stream.join(30)
        db = make_db_engine(url)
        answered = {c.payload["request_event_id"] for c in _events(db, "completion")}
        cut = {s.audit_id for s in streams} - answered
        assert cut  # some were still running or queued when the process died
        # A start that cannot bind its port writes no `startup` event.
        startups = len(_events(db, "startup"))
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            busy = int(taken.getsockname()[1])
            failed = _serve(models, tmp_path / "data", url, busy)
            assert failed.wait(120) != 0
        assert len(_events(db, "startup")) == startups
        restarted = _serve(models, tmp_path / "data", url, port)
        try:
            _wait_ready(port, restarted)
        finally:
            restarted.terminate()
            restarted.wait(60)
        interrupted = _events(db, "interrupted")
        assert {e.payload["request_event_id"] for e in interrupted} == cut
        assert len(interrupted) == len(cut)
        db.dispose()


def test_sigterm_ends_streams_after_the_grace_period_and_records_the_shutdown(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    with fresh_database() as (_, url):
        upgrade_database(url)
        port = free_port()
        # One sequence at a time, none ending early: the eight streams need far longer than
        # the grace period whatever the machine's speed, so some are cut (on a fast machine,
        # eight batched 400-token streams had all finished within the second).
        process = _serve(
            models,
            tmp_path / "data",
            url,
            port,
            SPECGATE_SHUTDOWN_GRACE_S="1",
            SPECGATE_MAX_NUM_SEQS="1",
        )
        try:
            _wait_ready(port, process)
            headers = {"authorization": f"Bearer {_app_key(url, tmp_path / 'data')}"}
            body = {**LONG, "max_tokens": 400, "min_tokens": 400}
            streams = [Stream(f"http://127.0.0.1:{port}", headers, body) for _ in range(8)]
            assert streams[0].first_chunk.wait(60)
            wait_until(lambda: all(s.audit_id for s in streams), 30, "every request event")
            stopped_at = time.monotonic()
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
            stop_s = time.monotonic() - stopped_at
        finally:
            process.kill()
        for stream in streams:
            stream.join(30)
        assert stop_s < 1 + 10, stop_s  # grace, then the cut streams' records and checkpoint
        ended = [s for s in streams if not s.done]
        assert ended, "the grace period should end some streams"
        for stream in ended:
            assert stream.error is not None and stream.error["code"] == "shutting_down"
        db = make_db_engine(url)
        outcomes = {
            c.payload["request_event_id"]: c.payload["outcome"] for c in _events(db, "completion")
        }
        assert {s.audit_id for s in streams} == set(outcomes)
        assert {outcomes[s.audit_id] for s in ended} == {"shutdown"}
        (shutdown,) = _events(db, "shutdown")
        after = [c for c in _events(db, "checkpoint") if c.seq > shutdown.seq]
        assert len(after) == 1, process.stderr.read().decode() if process.stderr else ""
        (checkpoint,) = after
        assert checkpoint.payload["size"] == shutdown.seq
        db.dispose()


# The grace of the stalled-shutdown test, and the slack for what follows its last database
# wait: the engine's stop and the process's exit on a busy 2-core machine.
STALLED_GRACE_S = 3.0
EXIT_SLACK_S = 2.0


def _stream_until_sigterm(port: int, headers: dict[str, str]) -> list[Stream]:
    """Streams that need far longer than any grace together (one sequence at a time; eight
    400-token streams, as the SIGTERM test above), each `request` event committed."""
    body = {**LONG, "max_tokens": 400, "min_tokens": 400}
    streams = [Stream(f"http://127.0.0.1:{port}", headers, body) for _ in range(8)]
    assert streams[0].first_chunk.wait(60)
    wait_until(lambda: all(s.audit_id for s in streams), 30, "every request event")
    return streams


def test_sigterm_in_a_database_stall_exits_within_the_grace_and_loses_no_record(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """SIGTERM with streams running and PostgreSQL stopped (SIGSTOP): every wait on the
    database is bounded by what is left of the grace (the default `audit_timeout_s`, 5 s, is
    longer than the whole 3 s grace); what cannot be committed goes to the spool, which the
    next start commits once the database is back."""
    with running_instance() as pg:
        url = pg.create_database("stalled_shutdown")
        upgrade_database(url)
        port = free_port()
        data = tmp_path / "data"
        grace = {"SPECGATE_SHUTDOWN_GRACE_S": str(STALLED_GRACE_S)}
        process = _serve(models, data, url, port, SPECGATE_MAX_NUM_SEQS="1", **grace)
        try:
            _wait_ready(port, process)
            streams = _stream_until_sigterm(
                port, {"authorization": f"Bearer {_app_key(url, data)}"}
            )
            pg.pause()
            try:
                stopped_at = time.monotonic()
                process.send_signal(signal.SIGTERM)
                assert process.wait(120) in (0, -signal.SIGTERM)
                stop_s = time.monotonic() - stopped_at
            finally:
                pg.resume()
        finally:
            process.kill()
        for stream in streams:
            stream.join(30)
        assert stop_s < STALLED_GRACE_S + EXIT_SLACK_S, stop_s
        ended = [s for s in streams if not s.done]
        assert ended and all(s.error and s.error["code"] == "shutting_down" for s in ended)
        restarted = _serve(models, data, url, port)  # commits the spool before its `startup`
        try:
            _wait_ready(port, restarted)
        finally:
            restarted.terminate()
            restarted.wait(60)
        db = make_db_engine(url)
        outcomes = [
            (c.payload["request_event_id"], c.payload["outcome"]) for c in _events(db, "completion")
        ]
        assert sorted(outcomes) == sorted(
            (s.audit_id, "ok" if s.done else "shutdown") for s in streams
        )
        assert len(_events(db, "shutdown")) == 2  # the stalled one (spooled), the restart's
        assert not _events(db, "interrupted")
        db.dispose()


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _ask_again(connection: http.client.HTTPConnection, headers: dict[str, str]) -> str:
    """A chat request on a kept-alive connection: "status code connection-header", or the
    error that took its answer's place."""
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(CHAT), headers)
        response = connection.getresponse()
        code = json.loads(response.read())["error"]["code"] if response.status != 200 else ""
    except (OSError, http.client.HTTPException) as error:
        return type(error).__name__
    return f"{response.status} {code} {response.getheader('connection')}"


def test_requests_on_kept_alive_connections_after_sigterm_get_503_shutting_down(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """Idle kept-alive connections stay open through the grace: a request sent on one right
    after SIGTERM (the listener already closed) is answered 503 `shutting_down` with
    `Connection: close`, not met by a closed connection; the refusals are counted in the
    `refused` event written before `shutdown`."""
    with fresh_database() as (_, url):
        upgrade_database(url)
        port = free_port()
        data = tmp_path / "data"
        process = _serve(models, data, url, port, SPECGATE_SHUTDOWN_GRACE_S="10")
        try:
            _wait_ready(port, process)
            headers = {
                "authorization": f"Bearer {_app_key(url, data)}",
                "content-type": "application/json",
            }
            connections = [
                http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(5)
            ]
            for connection in connections:
                connection.request("GET", "/v1/models", headers=headers)
                assert connection.getresponse().read()
            process.send_signal(signal.SIGTERM)
            signalled_at = time.monotonic()
            while _listening(port) and time.monotonic() - signalled_at < 5:
                time.sleep(0.01)
            answers = [_ask_again(connection, headers) for connection in connections]
            answered_s = time.monotonic() - signalled_at
            assert process.wait(60) in (0, -signal.SIGTERM)
        finally:
            process.kill()
        db = make_db_engine(url)
        refused = [
            refusal["count"]
            for event in _events(db, "refused")
            for refusal in event.payload["refusals"]
            if refusal["reason"] == "shutting_down"
        ]
        db.dispose()
    assert answers == ["503 shutting_down close"] * len(connections), answers
    assert answered_s < 1.0, answered_s
    assert refused == [len(connections)]
