"""Soak: thousands of mixed requests against a live gateway on loopback, in bounded time.

    python -m bench.soak [--tiny | --target DIR --draft DIR] [--database-url URL] [--requests 3000]
                         [--concurrency 16] [--max-queue 8] [--max-seconds 600] [--json FILE]

Mixes plain and streamed chat, completions, sampled requests with tiny temperatures and
top_p, and bad input (400s); the small queue makes overload (429s) part of the mix. At the end
it checks the audit log: the chain verifies, and every `request` event has exactly one
`completion`. Reports requests, answers by status and error code, events checked, RSS at
start and end (and every ``--rss-every`` seconds in between, the server's RSS curve),
latency p50/p99 of the served requests and the 429 answer time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import resource
import statistics
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from bench.gateway_overhead import serving, tiny_target
from gateway.audit.schema import audit_events
from gateway.dependencies import Services
from gateway.settings import load_settings

# A client's pause after a 429 (shorter than Retry-After, to keep the queue under pressure).
BACKOFF_S = 0.05


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


class RssCurve:
    """The server process's RSS every ``every_s`` seconds, in a thread, until ``stop``."""

    def __init__(self, every_s: float) -> None:
        self.points: list[tuple[float, float]] = []
        self._every_s = every_s
        self._stopped = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while True:
            self.points.append((round(time.monotonic() - self._started, 1), rss_mib()))
            if self._stopped.wait(self._every_s):
                return

    def stop(self) -> list[tuple[float, float]]:
        self._stopped.set()
        self._thread.join()
        return self.points


def bodies(model: str) -> list[tuple[str, dict[str, Any]]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "def add(a, b):"}]}
    return [
        ("/v1/chat/completions", {**chat, "max_tokens": 16}),
        ("/v1/chat/completions", {**chat, "max_tokens": 24, "stream": True}),
        ("/v1/completions", {"model": model, "prompt": "class Point:", "max_tokens": 16}),
        ("/v1/chat/completions", {**chat, "max_tokens": 8, "temperature": 1e-39}),
        ("/v1/chat/completions", {**chat, "max_tokens": 8, "top_p": 1e-46, "seed": 7}),
        ("/v1/chat/completions", {**chat, "max_tokens": 8, "n": 2, "temperature": 0.8}),
        ("/v1/chat/completions", {**chat, "temperature": 3}),  # 400
        ("/v1/chat/completions", {**chat, "max_tokens": 10**6}),  # 400 context length
    ]


def percentile(samples: list[float], q: int) -> float:
    if len(samples) < 2:
        return round(samples[0] * 1e3, 2) if samples else 0.0
    return round(statistics.quantiles(samples, n=100, method="inclusive")[q - 1] * 1e3, 2)


async def drive(
    base_url: str, api_key: str, model: str, requests: int, concurrency: int, max_seconds: float
) -> dict[str, Any]:
    mix = bodies(model)
    rng = random.Random(0)
    statuses: Counter[str] = Counter()
    served: list[float] = []
    refused: list[float] = []
    deadline = time.monotonic() + max_seconds
    sent = 0
    headers = {"authorization": f"Bearer {api_key}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=60, limits=limits
    ) as client:

        async def worker() -> None:
            nonlocal sent
            while sent < requests and time.monotonic() < deadline:
                sent += 1
                path, body = mix[rng.randrange(len(mix))]
                started = time.perf_counter()
                try:
                    response = await client.post(path, json=body)
                    text = response.text
                except httpx.HTTPError as error:
                    statuses[f"transport:{type(error).__name__}"] += 1
                    continue
                elapsed = time.perf_counter() - started
                code = None
                if response.status_code != 200:
                    code = response.json()["error"]["code"]
                elif body.get("stream") and not text.rstrip().endswith("data: [DONE]"):
                    code = "stream_not_done"
                statuses[f"{response.status_code}:{code}"] += 1
                if response.status_code == 200 and code is None:
                    served.append(elapsed)
                elif response.status_code == 429:
                    refused.append(elapsed)
                    await asyncio.sleep(BACKOFF_S)

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.monotonic() - started
    return {
        "requests": sum(statuses.values()),
        "wall_s": round(wall, 1),
        "answers": dict(sorted(statuses.items())),
        "served_p50_ms": percentile(served, 50),
        "served_p99_ms": percentile(served, 99),
        "queue_full_429_p50_ms": percentile(refused, 50),
        "queue_full_429_p99_ms": percentile(refused, 99),
        "queue_full_429_max_ms": round(max(refused) * 1e3, 2) if refused else 0.0,
    }


def drive_in_process(
    base_url: str, api_key: str, model: str, requests: int, concurrency: int, max_seconds: float
) -> dict[str, Any]:
    return asyncio.run(drive(base_url, api_key, model, requests, concurrency, max_seconds))


def check_log(services: Services) -> dict[str, Any]:
    with services.db.connect() as connection:
        rows = connection.execute(
            sa.select(audit_events.c.event_id, audit_events.c.kind, audit_events.c.payload)
        ).all()
    requests = {row.event_id for row in rows if row.kind == "request"}
    answered = Counter(row.payload["request_event_id"] for row in rows if row.kind == "completion")
    report = services.audit.verify()
    return {
        "events_checked": len(rows),
        "chain_verifies": report.ok,
        "requests_without_completion": len(requests - set(answered)),
        "requests_with_several_completions": sum(1 for n in answered.values() if n > 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path)
    parser.add_argument("--tiny", action="store_true", help="a tiny model built from a config")
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--database-url")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--max-queue", type=int, default=8)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rss-every", type=float, default=60.0, help="seconds between samples")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="specgate-soak-") as scratch:
        if args.tiny and args.target is not None:
            parser.error("--tiny and --target exclude each other")
        settings = load_settings(
            target=tiny_target(Path(scratch) / "tiny") if args.tiny else args.target,
            draft=args.draft,
            database_url=args.database_url or f"sqlite:///{scratch}/audit.db",
            data_dir=Path(scratch),
            max_queue=args.max_queue,
            log_level="warning",
        )
        with serving(settings) as (base_url, services):
            _, api_key = services.keys.create("app", "bench-soak", "bench")
            rss_start = rss_mib()
            curve = RssCurve(args.rss_every)
            # The client runs in its own process, so that it does not share the server's GIL.
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                result = pool.submit(
                    drive_in_process,
                    base_url,
                    api_key,
                    services.backend.card.model_name,
                    args.requests,
                    args.concurrency,
                    args.max_seconds,
                ).result()
            rss_end = rss_mib()
            rss_curve = curve.stop()
            _wait_for_spool(services)
            result.update(check_log(services))
            services.keys.revoke("bench-soak", "bench")
    result.update(
        {
            "rss_start_mib": rss_start,
            "rss_end_mib": rss_end,
            "rss_curve_s_mib": rss_curve,
            "concurrency": args.concurrency,
            "max_queue": args.max_queue,
            "load_average_1m": round(os.getloadavg()[0], 2),
        }
    )
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def _wait_for_spool(services: Services, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while services.spool.pending and time.monotonic() < deadline:
        time.sleep(0.1)


if __name__ == "__main__":
    main()
