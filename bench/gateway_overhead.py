"""Latency the gateway adds to a request over calling the engine directly.

    python -m bench.gateway_overhead [--tiny | --target DIR] [--database-url URL]
                                     [--requests 200] [--max-tokens 8] [--loop auto]
                                     [--json FILE]

Serves the real app with uvicorn on 127.0.0.1 (authentication, validation, chat template,
the two audit commits, JSON over HTTP with a keep-alive client) and, in the same process,
calls the same engine with the same prompt ids and sampling. Each round sends one request down
each path: direct, through the gateway with the `request` event committed before the engine
starts (``strict``), and through the gateway with the engine started while that commit is in
flight (``overlap``, ``start_before_request_commit``), and strict again with the two audit
appends sent from the database pool instead of the event loop (``strict_from_pool``: what
``gateway.audit.loop_append`` saves); the order rotates from round to round,
so that drift and warm caches hit all alike, and each round gives one "added" figure per
gateway mode (gateway minus direct). Greedy decoding without speculation keeps the engine's
share identical.

A second phase repeats the rounds with the request path stamped (``bench.request_timeline``):
for each mode, the mean and median time charged to each stamp, which sum to the request's
time as the client measured it, and the engine's excess over the direct call. The difference
between the stamped and the unstamped phase's added time is the stamps' own cost (and the
drift between the phases): the ``unattributed`` line.

``--tiny`` serves a two-layer model built from a config (random weights; run from the
repository root, it uses ``tests/tiny_models.py``): generation then takes about a
millisecond and its spread no longer hides the gateway's. Without ``--tiny`` or ``--target``
the demo target is used; without ``--database-url`` a scratch SQLite file.
The 1-minute load average is reported with the figures: on a shared machine it explains most
of the spread.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from bench.request_timeline import (
    ENGINE_STAMPS,
    PIECES,
    Timeline,
    engine_span,
    instrument,
    intervals,
    stamp_handle,
    stamped_app,
)
from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from engine.serving.service import Engine
from gateway.app import create_app
from gateway.audit.loop_append import LoopAppender
from gateway.backends.local import LocalBackend
from gateway.dependencies import Services
from gateway.generation.job import build_job
from gateway.observability.logging import configure_logging
from gateway.schemas import ChatCompletionRequest
from gateway.server import GracefulServer, uvicorn_config
from gateway.settings import Settings, load_settings

MESSAGES = [{"role": "user", "content": "def add(a, b):"}]
# The gateway's two orderings of the `request` commit and the engine's start.
MODES = {"strict": False, "overlap": True}
# The strict mode with its two audit appends sent from the database pool instead of the event
# loop (``gateway.audit.loop_append``), alternated with the others: what the loop path saves.
POOL_MODE = "strict_from_pool"
MODES[POOL_MODE] = False
PATHS = ("direct", *MODES)


@dataclass
class Percentiles:
    p50_ms: float
    p99_ms: float
    mean_ms: float


@dataclass
class Breakdown:
    """One gateway mode's stamped requests (ms). ``added_pieces_mean_ms``: the mean time charged
    to each stamp outside the engine, the engine's time through the gateway minus the direct
    call's, less the direct call's own wake-up; they sum to the stamped phase's added mean."""

    added: Percentiles
    added_pieces_mean_ms: dict[str, float]
    added_pieces_sum_ms: float
    # The median time charged to each stamp of a request through the gateway (engine included).
    request_pieces_p50_ms: dict[str, float]
    # The unstamped phase's added mean minus the pieces' sum: what the stamps do not explain
    # (negative when the stamps themselves cost more than the phases drift).
    unattributed_mean_ms: float


@dataclass
class OverheadResult:
    requests: int
    max_tokens: int
    database: str
    loop: str
    load_average_1m: float
    direct: Percentiles
    gateway: dict[str, Percentiles]
    added: dict[str, Percentiles]
    breakdown: dict[str, Breakdown]
    # Each piece timed on its own, outside any request (the commit floor: PostgreSQL only).
    pieces_alone_p50_ms: dict[str, float]


PIECE_REPEATS = 200
WARM_UP_ROUNDS = 10


# The pause before each call of an "after idle" figure: about a request's engine time, so that
# the database backend, the WAL writer and the caches are as cold as between a request's two
# commits (back to back, a commit costs about half as much).
IDLE_PAUSE_S = 0.01


def _median_ms(
    call: Callable[[], object], repeats: int = PIECE_REPEATS, pause_s: float = 0.0
) -> float:
    samples = []
    for _ in range(repeats):
        if pause_s:
            time.sleep(pause_s)
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return round(statistics.median(samples) * 1e3, 3)


def pieces_alone(
    base_url: str, services: Services, api_key: str, max_tokens: int
) -> dict[str, float]:
    """Each piece of the request path timed on its own (median over PIECE_REPEATS), in the
    serving process, while no request is in flight."""
    backend = services.backend
    body = ChatCompletionRequest.model_validate(
        {"model": backend.card.model_name, "messages": MESSAGES, "max_tokens": max_tokens}
    )
    loop = asyncio.new_event_loop()
    offload = services.offload
    principal = services.keys.authenticate(api_key)
    assert principal is not None
    job = build_job(body, backend, services.settings.max_prompt_bytes)
    request_payload = {"request_id": job.request_id, "bench": True, "prompt_tokens": 9}
    completion_payload = {"request_event_id": "bench", "outcome": "ok", "latency_s": 0.01}
    with httpx.Client(base_url=base_url, timeout=60) as client:
        figures = {
            "http_round_trip_healthz": _median_ms(lambda: client.get("/healthz")),
            # A repeat caller's key is checked in the key cache; the lookup is the first call's.
            "authentication_cached": _median_ms(lambda: services.key_cache.get(api_key)),
            "authentication_lookup_uncached": _median_ms(
                lambda: services.keys.authenticate(api_key)
            ),
            "validate_template_tokenize": _median_ms(
                lambda: build_job(body, backend, services.settings.max_prompt_bytes)
            ),
            # At the head this process wrote (one statement) and, alternated with it, after
            # another writer moved the head (the locking transaction).
            **_alternated_ms(
                {
                    "request_event_commit": lambda: services.audit.append(
                        "bench", principal.key_id, request_payload
                    ),
                    "request_event_commit_locking": lambda: _locking_append(
                        services, principal.key_id, request_payload
                    ),
                }
            ),
            "completion_event_commit": _median_ms(
                lambda: services.audit.append("bench", principal.key_id, completion_payload)
            ),
            "completion_event_commit_after_idle": _median_ms(
                lambda: services.audit.append("bench", principal.key_id, completion_payload),
                pause_s=IDLE_PAUSE_S,
            ),
            **_commit_floor(services),
            "thread_hand_off_db_pool": _median_ms(
                lambda: loop.run_until_complete(offload.db(lambda: None))
            ),
            "thread_hand_off_prepare_pool": _median_ms(
                lambda: loop.run_until_complete(offload.prepare(lambda: None))
            ),
        }
    loop.close()
    return figures


def _alternated_ms(calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each call's median over PIECE_REPEATS rounds, the calls taking turns in each round."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(PIECE_REPEATS):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - started)
    return {name: round(statistics.median(s) * 1e3, 3) for name, s in samples.items()}


def _locking_append(services: Services, actor: str, payload: dict[str, Any]) -> None:
    services.audit.forget_known_head()
    services.audit.append("bench", actor, payload)


def _commit_floor(services: Services) -> dict[str, float]:
    """PostgreSQL only: the cheapest durable commit, a transaction that writes one WAL record
    (a logical message, no table) and so waits for the WAL flush as an append does. (A
    transaction that writes no WAL, ``SELECT txid_current()`` for one, commits without a
    flush and measures only the round trips.) The rest of an append's time is its own
    statements."""
    if services.db.dialect.name != "postgresql":
        return {}

    def commit() -> None:
        with services.db.begin() as connection:
            connection.execute(sa.select(sa.func.pg_logical_emit_message(True, "specgate", "")))

    return {
        "durable_commit_floor": _median_ms(commit),
        "durable_commit_floor_after_idle": _median_ms(commit, pause_s=IDLE_PAUSE_S),
    }


def percentiles(samples_s: list[float]) -> Percentiles:
    ordered = sorted(samples_s)
    cut = statistics.quantiles(ordered, n=100, method="inclusive")
    return Percentiles(
        p50_ms=round(statistics.median(ordered) * 1e3, 3),
        p99_ms=round(cut[98] * 1e3, 3),
        mean_ms=round(statistics.fmean(ordered) * 1e3, 3),
    )


@contextmanager
def serving(
    settings: Settings, timeline: Timeline | None = None, loop: str = "auto", port: int = 0
) -> Iterator[tuple[str, Services]]:
    """The app served by uvicorn on 127.0.0.1 in a thread of this process; with ``timeline``,
    its requests are stamped (``bench.request_timeline``)."""
    app = create_app(settings)
    listener = socket.socket()
    # Accepted sockets inherit this; without it Nagle's algorithm meets delayed ACKs and
    # every keep-alive response waits ~40 ms (uvicorn sets it only on sockets it binds).
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    listener.bind(("127.0.0.1", port))
    config = uvicorn_config(
        app if timeline is None else stamped_app(app, timeline),  # type: ignore[arg-type]
        settings,
        log_level="warning",
        loop=loop,
        lifespan="on",
    )
    server = GracefulServer(config, app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the gateway did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", app.state.services
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        listener.close()


def built_in_engine(services: Services) -> Engine:
    """The engine the gateway serves from, called directly for the baseline."""
    backend = services.backend
    assert isinstance(backend, LocalBackend), "the overhead bench needs the built-in backend"
    return backend.engine


@dataclass
class Rounds:
    """Per path, each round's seconds; per gateway mode and for the direct calls, each
    round's stamps (when stamped)."""

    seconds: dict[str, list[float]]
    stamps: dict[str, list[list[tuple[str, float]]]]


def measure(
    base_url: str,
    services: Services,
    api_key: str,
    requests: int,
    max_tokens: int,
    timeline: Timeline,
) -> Rounds:
    engine = built_in_engine(services)
    body = {
        "model": engine.model_name,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "speculative": False,
    }
    template = engine.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    direct_request = GenerationRequest(
        prompt_ids=tuple(engine.tokenizer.encode(template, add_special_tokens=False)),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        speculative=SpeculativeChoice(method="none"),
    )
    settings = {
        mode: services.settings.model_copy(update={"start_before_request_commit": overlap})
        for mode, overlap in MODES.items()
    }
    rounds = Rounds({path: [] for path in PATHS}, {path: [] for path in PATHS})
    from_loop = services.appender
    from_pool = LoopAppender(
        services.audit, services.offload.submit_db, None, {}, services.settings.audit_lock_timeout_s
    )
    expected_tokens = len(engine.generate(direct_request).token_ids)
    with loopback_client(base_url, api_key) as client:
        # The direct call waits as the gateway does, woken once by the final delta
        # (``result()`` would wake its thread at every token, slowing the engine's thread).
        waiting = asyncio.new_event_loop()

        def one_direct() -> float:
            started = time.perf_counter()
            timeline.mark("engine submitted")
            handle = stamp_handle(engine.submit(direct_request), timeline)
            waiting.run_until_complete(handle.result_async())
            return time.perf_counter() - started

        def one_through_gateway(mode: str) -> float:
            services.settings = settings[mode]
            services.appender = from_pool if mode == POOL_MODE else from_loop
            assert client.stdin is not None and client.stdout is not None
            client.stdin.write(json.dumps(body) + "\n")
            client.stdin.flush()
            answer = json.loads(client.stdout.readline())
            if answer["status"] != 200 or answer["tokens"] != expected_tokens:
                raise RuntimeError(f"the gateway answered {answer}, not {expected_tokens} tokens")
            timeline.mark_at("client sent", answer["sent"])
            timeline.mark_at("client received", answer["received"])
            return float(answer["received"] - answer["sent"])

        calls: dict[str, Callable[[], float]] = {
            "direct": one_direct,
            **{mode: functools.partial(one_through_gateway, mode) for mode in MODES},
        }
        for index in range(requests + WARM_UP_ROUNDS):
            shift = index % len(PATHS)
            for path in PATHS[shift:] + PATHS[:shift]:
                timeline.take()
                seconds = calls[path]()
                marks = timeline.take()
                if index >= WARM_UP_ROUNDS:
                    rounds.seconds[path].append(seconds)
                    if marks:
                        rounds.stamps[path].append(marks)
        waiting.close()
    # The next phase (and ``instrument``) must find the loop's appender, not the pool mode's
    # if that ran last: with 100 requests it did, and the stamped phase then sent the strict
    # and overlap modes' appends through the pool too.
    services.appender = from_loop
    return rounds


@contextmanager
def loopback_client(base_url: str, api_key: str) -> Iterator[subprocess.Popen[str]]:
    """``bench.loopback_client`` in its own process (the key passed in its environment)."""
    client = subprocess.Popen(
        [sys.executable, "-m", "bench.loopback_client", base_url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "SPECGATE_BENCH_KEY": api_key},
    )
    try:
        yield client
    finally:
        assert client.stdin is not None
        client.stdin.close()
        client.wait(timeout=30)


def added(rounds: Rounds, mode: str) -> list[float]:
    return [
        gateway - direct
        for gateway, direct in zip(rounds.seconds[mode], rounds.seconds["direct"], strict=True)
    ]


ENGINE_EXCESS = "engine: through the gateway minus the direct call"
DIRECT_WAKE = "the direct call's own wake-up (subtracted)"


def breakdown(stamped: Rounds, unstamped: Rounds, mode: str) -> Breakdown:
    per_request = [intervals(marks) for marks in stamped.stamps[mode]]
    names = list(PIECES)
    names += sorted({name for charged in per_request for name in charged} - set(names))
    means = {name: statistics.fmean(c.get(name, 0.0) for c in per_request) for name in names}
    medians = {name: statistics.median(c.get(name, 0.0) for c in per_request) for name in names}
    engine_direct = statistics.fmean(engine_span(m) for m in stamped.stamps["direct"])
    direct_mean = statistics.fmean(stamped.seconds["direct"])
    outside = {name: value for name, value in means.items() if name not in ENGINE_STAMPS}
    pieces = {
        **outside,
        ENGINE_EXCESS: sum(means[name] for name in ENGINE_STAMPS) - engine_direct,
        DIRECT_WAKE: engine_direct - direct_mean,
    }
    pieces_sum = sum(pieces.values())
    return Breakdown(
        added=percentiles(added(stamped, mode)),
        added_pieces_mean_ms={name: round(value * 1e3, 3) for name, value in pieces.items()},
        added_pieces_sum_ms=round(pieces_sum * 1e3, 3),
        request_pieces_p50_ms={name: round(value * 1e3, 3) for name, value in medians.items()},
        unattributed_mean_ms=round(
            (statistics.fmean(added(unstamped, mode)) - pieces_sum) * 1e3, 3
        ),
    )


def tiny_target(out: Path) -> Path:
    """A two-layer Llama with random weights (the tests' builder), saved in ``out``."""
    from tests.tiny_models import build_model, build_tokenizer

    return build_model(out, build_tokenizer(), seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--target", type=Path)
    model.add_argument("--tiny", action="store_true", help="a tiny model built from a config")
    parser.add_argument("--database-url")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--loop",
        default="auto",
        help="uvicorn's event loop: auto (uvloop if installed), asyncio, uvloop",
    )
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()

    timeline = Timeline()
    with tempfile.TemporaryDirectory(prefix="specgate-overhead-") as scratch:
        target = tiny_target(Path(scratch) / "tiny") if args.tiny else args.target
        settings = load_settings(
            target=target,
            method="none",
            database_url=args.database_url or f"sqlite:///{scratch}/audit.db",
            data_dir=Path(scratch),
            checkpoint_interval_s=3600.0,
            log_level="warning",
        )
        # As ``specgate serve`` does: at this level, no line per request.
        configure_logging(log_format="json", level=settings.log_level, stream=sys.stderr)
        with serving(settings, timeline, args.loop) as (base_url, services):
            _, api_key = services.keys.create("app", "bench-gateway-overhead", "bench")
            unstamped = measure(
                base_url, services, api_key, args.requests, args.max_tokens, timeline
            )
            instrument(services, timeline)
            timeline.enabled = True
            stamped = measure(base_url, services, api_key, args.requests, args.max_tokens, timeline)
            timeline.enabled = False
            services.settings = settings
            alone = pieces_alone(base_url, services, api_key, args.max_tokens)
            services.keys.revoke("bench-gateway-overhead", "bench")
    result = OverheadResult(
        requests=args.requests,
        max_tokens=args.max_tokens,
        database=settings.public_snapshot()["database_url"].split(":", 1)[0],
        loop=timeline.loop,
        load_average_1m=round(os.getloadavg()[0], 2),
        direct=percentiles(unstamped.seconds["direct"]),
        gateway={mode: percentiles(unstamped.seconds[mode]) for mode in MODES},
        added={mode: percentiles(added(unstamped, mode)) for mode in MODES},
        breakdown={mode: breakdown(stamped, unstamped, mode) for mode in MODES},
        pieces_alone_p50_ms=alone,
    )
    report: dict[str, Any] = asdict(result)
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
