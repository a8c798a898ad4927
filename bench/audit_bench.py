"""Audit append throughput on PostgreSQL with 1, 8 and 32 concurrent writers.

    python -m bench.audit_bench [--server-url postgresql://postgres@127.0.0.1:5432] [--seconds 5]

Creates a scratch database on the server, migrates it, lets N threads append ``request``-sized
events for a fixed time, reports events/s and the p50/p99 latency of one ``append`` call, checks
that the chain verifies, and drops the database.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from gateway.audit.log import AuditLog
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine, upgrade_database

WRITER_COUNTS = (1, 8, 32)

# Shaped like the gateway's ``request`` event: hashes, model versions, sampling, no content.
SAMPLE_PAYLOAD = {
    "route": "/v1/chat/completions",
    "model": "specgate-demo",
    "target": {"name": "demo-target", "version": "sha256:" + "a" * 64},
    "draft": {"name": "demo-draft", "version": "sha256:" + "b" * 64},
    "speculative": {"method": "draft", "num_speculative_tokens": 4},
    "sampling": {"max_tokens": 128, "temperature": 0.7, "top_p": 0.95, "top_k": 0, "seed": 42},
    "prompt_sha256": "c" * 64,
    "prompt_tokens": 412,
}


@dataclass(frozen=True)
class RunResult:
    writers: int
    events: int
    seconds: float
    events_per_s: float
    p50_ms: float
    p99_ms: float


def run_writers(log: AuditLog, writers: int, seconds: float) -> RunResult:
    latencies: list[list[float]] = [[] for _ in range(writers)]
    start_barrier = threading.Barrier(writers + 1)
    deadline = 0.0

    def writer(index: int) -> None:
        own = latencies[index]
        start_barrier.wait()
        while time.perf_counter() < deadline:
            began = time.perf_counter()
            log.append("request", f"bench-{index}", SAMPLE_PAYLOAD)
            own.append(time.perf_counter() - began)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    deadline = time.perf_counter() + seconds
    began = time.perf_counter()
    start_barrier.wait()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    merged = sorted(value for own in latencies for value in own)
    quantiles = statistics.quantiles(merged, n=100, method="inclusive")
    return RunResult(
        writers=writers,
        events=len(merged),
        seconds=round(elapsed, 3),
        events_per_s=round(len(merged) / elapsed, 1),
        p50_ms=round(statistics.median(merged) * 1000, 3),
        p99_ms=round(quantiles[98] * 1000, 3),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-url", default="postgresql://postgres@127.0.0.1:5432")
    parser.add_argument("--maintenance-db", default="test")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    name = f"specgate_bench_{uuid.uuid4().hex[:8]}"
    admin_url = f"{args.server_url}/{args.maintenance_db}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = f"{args.server_url}/{name}"
    db = make_db_engine(url)
    try:
        upgrade_database(url)
        with tempfile.TemporaryDirectory() as key_dir:
            log = AuditLog(db, CheckpointSigner.load_or_create(Path(key_dir) / "key.pem"))
            results = [run_writers(log, writers, args.seconds) for writers in WRITER_COUNTS]
            report = log.verify()
    finally:
        db.dispose()
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    print(f"{'writers':>7} {'events':>7} {'events/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for result in results:
        print(
            f"{result.writers:>7} {result.events:>7} {result.events_per_s:>9.0f} "
            f"{result.p50_ms:>8.2f} {result.p99_ms:>8.2f}"
        )
    print(f"chain after the runs: {report.reason}")
    print("load average (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if args.json:
        args.json.write_text(
            json.dumps({"results": [asdict(r) for r in results], "verify": report.as_dict()})
        )
    if not report.ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
