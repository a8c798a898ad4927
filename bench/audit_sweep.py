"""Cost of the scheduled re-verification of the signed audit history on PostgreSQL.

    python -m bench.audit_sweep [--server-url postgresql://postgres@127.0.0.1:5432]
                                [--events 100000] [--slices 1000,10000]

In a scratch database, ``--events`` ``request``-sized events are appended (with MACs and the
Merkle tree, a thousand per transaction) and a checkpoint is signed; then whole sweeps are run
at each slice size, timing every slice (one read of that many events, every check). It prints
events/s, the median and worst slice, and what the default schedule (a day) costs for a log of
that size: slices a tick, and the share of one core the sweep keeps busy.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.audit_bench import SAMPLE_PAYLOAD, scratch_database
from gateway.audit.log import AuditLog, insert_events
from gateway.audit.mac import EventMac
from gateway.audit.signing import CheckpointSigner
from gateway.audit.sweep import slice_size, tick_seconds
from gateway.db import make_db_engine, upgrade_database, write_connection

BATCH = 1000
DAY_S = 86400.0


def fill(log: AuditLog, url: str, events: int) -> None:
    db = make_db_engine(url)
    event = ("request", "key_bench", SAMPLE_PAYLOAD)
    for start in range(0, events, BATCH):
        with write_connection(db) as connection, connection.begin():
            insert_events(connection, [event] * min(BATCH, events - start), log.mac)
    db.dispose()


def sweep_once(log: AuditLog, slice_events: int) -> list[float]:
    """Seconds of each slice of one whole sweep."""
    times: list[float] = []
    while True:
        started = time.perf_counter()
        done = log.reverify(slice_events)
        times.append(time.perf_counter() - started)
        if done:
            return times
        if log.tamper is not None:
            raise SystemExit(f"the sweep raised the alarm: {log.tamper}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-url", default="postgresql://postgres@127.0.0.1:5432")
    parser.add_argument("--maintenance-db", default="test")
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--slices", default="1000,10000")
    args = parser.parse_args()
    with scratch_database(args.server_url, args.maintenance_db) as url:
        upgrade_database(url)
        db = make_db_engine(url)
        with tempfile.TemporaryDirectory() as keys:
            signer = CheckpointSigner.load_or_create(Path(keys) / "signing.pem")
            log = AuditLog(db, signer, EventMac(b"k" * 32))
            started = time.perf_counter()
            fill(log, url, args.events)
            print(f"{args.events} events appended in {time.perf_counter() - started:.1f} s")
            log.checkpoint()
            size = log.signed_state.frontier.size
            for slice_events in (int(part) for part in args.slices.split(",")):
                times = sweep_once(log, slice_events)
                total = sum(times)
                print(
                    f"slices of {slice_events}: {size / total:,.0f} events/s; slice median "
                    f"{statistics.median(times) * 1000:.1f} ms, worst {max(times) * 1000:.1f} ms"
                )
            tick = tick_seconds(DAY_S)
            per_tick = slice_size(size, tick, DAY_S)
            busy = size / (size / total) / (0.9 * DAY_S)
            print(
                f"default schedule (a day): {per_tick} events every {tick:.0f} s; "
                f"{busy * 100:.4f} % of one core for a log of {size} events"
            )
        db.dispose()


if __name__ == "__main__":
    main()
