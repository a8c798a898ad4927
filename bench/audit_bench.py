"""Audit append throughput and proof cost on PostgreSQL.

    python -m bench.audit_bench [--server-url postgresql://postgres@127.0.0.1:5432]
                                [--seconds 5] [--proof-sizes 1000,100000,1000000]

Appends: in scratch databases, N threads (1, 8, 32) append ``request``-sized events for a
fixed time, with the full log (Merkle tree nodes, per-event HMAC, compact range in the head
row) and with the hash chain alone (same head-row lock, same group commit, no MAC, no tree),
alternating, ``--rounds`` times each; it reports events/s and p50/p99 latency of one
``append`` call per run, the median rate of each mode, and checks that the full log verifies.

Proofs: for each size n, a tree of n leaves is bulk-loaded (COPY of its nodes, no events),
then the median and p99 time of an inclusion proof and of a consistency proof, as the gateway
serves them (one query per tree level), are measured over random indices and sizes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import sql

from gateway.audit.canonical import event_bytes, format_timestamp
from gateway.audit.log import AppendedEvent, AuditLog, lock_head
from gateway.audit.mac import EventMac
from gateway.audit.merkle import CompactRange, leaf_hash
from gateway.audit.schema import audit_events, audit_head
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine, upgrade_database, write_connection

WRITER_COUNTS = (1, 8, 32)
PROOF_SAMPLES = 200

# Shaped like the gateway's ``request`` event: hashes, model versions, sampling, no content.
SAMPLE_PAYLOAD = {
    "route": "/v1/chat/completions",
    "model": "specgate-demo",
    "target": {"name": "demo-target", "version": "sha256:" + "a" * 64},
    "artefacts": [{"kind": "draft_model", "name": "demo-draft", "version": "sha256:" + "b" * 64}],
    "speculative": {"method": "draft", "num_speculative_tokens": 4},
    "sampling": {"max_tokens": 128, "temperature": 0.7, "top_p": 0.95, "top_k": 0, "seed": 42},
    "prompt_sha256": "c" * 64,
    "prompt_tokens": 412,
}


@dataclass(frozen=True)
class RunResult:
    mode: str
    writers: int
    events: int
    seconds: float
    events_per_s: float
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class ProofResult:
    tree_size: int
    load_s: float
    inclusion_p50_ms: float
    inclusion_p99_ms: float
    consistency_p50_ms: float
    consistency_p99_ms: float


class ChainOnlyLog(AuditLog):
    """The baseline: the same log, lock and group commit, writing the hash chain alone."""

    def _write(self, batch: list[Any]) -> None:
        try:
            with write_connection(self._db) as connection, connection.begin():
                results = _chain_only_insert(connection, [(p.actor, p.payload) for p in batch])
        except BaseException as exc:
            for pending in batch:
                pending.error = exc
        else:
            for pending, result in zip(batch, results, strict=True):
                pending.result = result
        for pending in batch:
            pending.done = True
            pending.wake.set()


def _chain_only_insert(
    connection: sa.Connection, events: Sequence[tuple[str | None, dict[str, Any]]]
) -> list[AppendedEvent]:
    head = lock_head(connection, 5.0)
    seq, prev_hash = head.tree_size, head.head_hash
    rows, appended = [], []
    for actor, payload in events:
        seq += 1
        created_at = datetime.now(UTC)
        fields: dict[str, Any] = {
            "seq": seq,
            "event_id": str(uuid.uuid4()),
            "kind": "request",
            "actor": actor,
            "payload": payload,
            "prev_hash": prev_hash,
        }
        data = event_bytes(**fields, created_at=format_timestamp(created_at))
        digest = hashlib.sha256(data).hexdigest()
        rows.append({**fields, "created_at": created_at, "event_hash": digest})
        appended.append(AppendedEvent(seq, fields["event_id"], digest, created_at))
        prev_hash = digest
    connection.execute(sa.insert(audit_events), rows)
    connection.execute(
        sa.update(audit_head).where(audit_head.c.id == 1).values(tree_size=seq, head_hash=prev_hash)
    )
    return appended


def run_writers(log: AuditLog, mode: str, writers: int, seconds: float) -> RunResult:
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
    return RunResult(
        mode=mode,
        writers=writers,
        events=len(merged),
        seconds=round(elapsed, 3),
        events_per_s=round(len(merged) / elapsed, 1),
        p50_ms=round(statistics.median(merged) * 1000, 3),
        p99_ms=round(_p99(merged) * 1000, 3),
    )


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


@contextmanager
def scratch_database(server_url: str, maintenance_db: str) -> Iterator[str]:
    name = f"specgate_bench_{uuid.uuid4().hex[:8]}"
    admin_url = f"{server_url}/{maintenance_db}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        url = f"{server_url}/{name}"
        upgrade_database(url)
        yield url
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def bulk_load_tree(url: str, size: int) -> None:
    """A log of ``size`` small events and its tree, loaded with COPY on two connections (the
    events are not chained: proofs read only the nodes and the leaves' events)."""
    compact = CompactRange()
    created_at = datetime.now(UTC)
    stamp = format_timestamp(created_at)
    with psycopg.connect(url) as for_events, psycopg.connect(url) as for_nodes:
        with (
            for_events.cursor().copy(
                "COPY audit_events (seq, event_id, created_at, kind, actor, payload, "
                "prev_hash, event_hash) FROM STDIN"
            ) as events,
            for_nodes.cursor().copy(
                "COPY audit_merkle_nodes (level, idx, hash) FROM STDIN (FORMAT BINARY)"
            ) as nodes,
        ):
            nodes.set_types(["int2", "int8", "bytea"])
            for seq in range(1, size + 1):
                event_id, payload, prev_hash = str(uuid.UUID(int=seq)), {"i": seq}, "0" * 64
                data = event_bytes(
                    seq=seq,
                    event_id=event_id,
                    created_at=stamp,
                    kind="request",
                    actor=None,
                    payload=payload,
                    prev_hash=prev_hash,
                )
                events.write_row(
                    (
                        seq,
                        event_id,
                        created_at,
                        "request",
                        None,
                        json.dumps(payload),
                        prev_hash,
                        hashlib.sha256(data).hexdigest(),
                    )
                )
                for (level, index), digest in compact.append(leaf_hash(data)):
                    if level:
                        nodes.write_row((level, index, digest))
        for_nodes.execute(
            "UPDATE audit_head SET tree_size = %s, frontier = %s",
            (size, b"".join(compact.hashes)),
        )


def time_proofs(url: str, size: int, log_factory: Callable[[sa.Engine], AuditLog]) -> ProofResult:
    began = time.perf_counter()
    bulk_load_tree(url, size)
    load_s = time.perf_counter() - began
    db = make_db_engine(url)
    try:
        log = log_factory(db)
        rng = random.Random(size)
        log.inclusion_proof(0, size)  # warm the pool
        inclusion, consistency = [], []
        for _ in range(PROOF_SAMPLES):
            index = rng.randrange(size)
            began = time.perf_counter()
            log.inclusion_proof(index, size)
            inclusion.append(time.perf_counter() - began)
            old = rng.randrange(1, size)
            began = time.perf_counter()
            log.consistency_proof(old, size)
            consistency.append(time.perf_counter() - began)
    finally:
        db.dispose()
    return ProofResult(
        tree_size=size,
        load_s=round(load_s, 1),
        inclusion_p50_ms=round(statistics.median(inclusion) * 1000, 3),
        inclusion_p99_ms=round(_p99(inclusion) * 1000, 3),
        consistency_p50_ms=round(statistics.median(consistency) * 1000, 3),
        consistency_p99_ms=round(_p99(consistency) * 1000, 3),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-url", default="postgresql://postgres@127.0.0.1:5432")
    parser.add_argument("--maintenance-db", default="test")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each mode per count")
    parser.add_argument("--proof-sizes", default="1000,100000,1000000")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    results: list[RunResult] = []
    with tempfile.TemporaryDirectory() as key_dir:
        signer = CheckpointSigner.load_or_create(Path(key_dir) / "key.pem")
        mac = EventMac.load_or_create(Path(key_dir) / "mac")
        # Interleaved, so both modes see the same machine load; each pair repeated.
        for writers in WRITER_COUNTS:
            for mode in ("chain only", "merkle+mac") * args.rounds:
                with scratch_database(args.server_url, args.maintenance_db) as url:
                    db = make_db_engine(url)
                    try:
                        if mode == "chain only":
                            log: AuditLog = ChainOnlyLog(db, signer)
                        else:
                            log = AuditLog(db, signer, mac, Path(key_dir) / "state.json")
                        results.append(run_writers(log, mode, writers, args.seconds))
                        if mode != "chain only":
                            report = log.verify()
                            if not report.ok:
                                raise SystemExit(f"the log does not verify: {report.reason}")
                    finally:
                        db.dispose()
                    (Path(key_dir) / "state.json").unlink(missing_ok=True)
        proofs = []
        for size in (int(s) for s in args.proof_sizes.split(",") if s):
            with scratch_database(args.server_url, args.maintenance_db) as url:
                proofs.append(time_proofs(url, size, lambda db: AuditLog(db, signer)))

    print(f"{'mode':>11} {'writers':>7} {'events':>7} {'events/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for result in results:
        print(
            f"{result.mode:>11} {result.writers:>7} {result.events:>7} "
            f"{result.events_per_s:>9.0f} {result.p50_ms:>8.2f} {result.p99_ms:>8.2f}"
        )
    for writers in WRITER_COUNTS:
        rates = {
            mode: statistics.median(
                r.events_per_s for r in results if r.writers == writers and r.mode == mode
            )
            for mode in ("chain only", "merkle+mac")
        }
        print(
            f"median events/s at {writers:>2} writers: chain only {rates['chain only']:.0f}, "
            f"merkle+mac {rates['merkle+mac']:.0f} "
            f"({rates['merkle+mac'] / rates['chain only']:.0%})"
        )
    print(
        f"{'tree size':>10} {'load s':>7} {'incl p50':>9} {'incl p99':>9} "
        f"{'cons p50':>9} {'cons p99':>9}  (ms)"
    )
    for proof in proofs:
        print(
            f"{proof.tree_size:>10} {proof.load_s:>7.1f} {proof.inclusion_p50_ms:>9.2f} "
            f"{proof.inclusion_p99_ms:>9.2f} {proof.consistency_p50_ms:>9.2f} "
            f"{proof.consistency_p99_ms:>9.2f}"
        )
    print("load average (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"appends": [asdict(r) for r in results], "proofs": [asdict(p) for p in proofs]}
            )
        )


if __name__ == "__main__":
    main()
