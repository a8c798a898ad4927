"""Key lookup and audit append through a pool that pings each checkout (``pool_pre_ping``)
and through the gateway's pool (a socket poll, no round trip), paired in one process.

    python -m bench.checkout_check [--server postgresql://postgres@127.0.0.1:5432]
                                   [--iterations 300]

Each iteration runs a lookup and an append on both pools, in alternating order, against a
scratch database (created and dropped). Prints the medians in ms and the 1-minute load
average: on a shared machine only the paired comparison means anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psycopg
import sqlalchemy as sa
from psycopg import sql

from gateway.audit.log import AuditLog
from gateway.audit.mac import EventMac
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine, normalise_url, upgrade_database
from gateway.keys import KeyStore


def _timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def measure(url: str, iterations: int, scratch: Path) -> dict[str, float]:
    upgrade_database(url)
    signer = CheckpointSigner.load_or_create(scratch / "signing.pem")
    pools = {
        "pre_ping": sa.create_engine(normalise_url(url), pool_pre_ping=True, pool_size=10),
        "socket_check": make_db_engine(url),
    }
    mac = EventMac.load_or_create(scratch / "audit-mac-key")
    logs = {side: AuditLog(db, signer, mac) for side, db in pools.items()}
    stores = {side: KeyStore(db, logs[side]) for side, db in pools.items()}
    _, key = stores["socket_check"].create("app", "bench-checkout", "bench")
    samples: dict[str, list[float]] = {f"{s}_{p}": [] for s in pools for p in ("lookup", "append")}
    try:
        for index in range(iterations):
            order = list(pools) if index % 2 == 0 else list(reversed(pools))
            for side in order:
                lookup = _timed(partial(stores[side].authenticate, key))
                append = _timed(partial(logs[side].append, "bench", None, {"i": index}))
                samples[f"{side}_lookup"].append(lookup)
                samples[f"{side}_append"].append(append)
    finally:
        for db in pools.values():
            db.dispose()
    return {name: round(statistics.median(values) * 1e3, 3) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--server", default="postgresql://postgres@127.0.0.1:5432")
    parser.add_argument("--iterations", type=int, default=300)
    args = parser.parse_args()
    name = f"specgate_checkout_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{args.server}/postgres", autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        with tempfile.TemporaryDirectory(prefix="specgate-checkout-") as scratch:
            medians = measure(f"{args.server}/{name}", args.iterations, Path(scratch))
    finally:
        with psycopg.connect(f"{args.server}/postgres", autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
    print(json.dumps({"load_average_1m": round(os.getloadavg()[0], 2), "median_ms": medians}))


if __name__ == "__main__":
    main()
