"""Crash: kill the gateway with SIGKILL mid-traffic, restart it, check the audit log; repeat.

    python -m bench.crash --target DIR --draft DIR --database-url URL [--rounds 5]
                          [--streams 8] [--json FILE]

Each round starts ``specgate serve`` on loopback (same data directory and database every
round), opens ``--streams`` streaming requests, kills the process at a random moment while
they run, and restarts it. After each restart: every `request` event has exactly one
`completion` or `interrupted` event, and the whole chain verifies. Reports per round how many
requests were cut, and the totals.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from gateway.audit.log import AuditLog
from gateway.audit.mac import EventMac
from gateway.audit.schema import audit_events
from gateway.audit.signing import CheckpointSigner
from gateway.db import make_db_engine, upgrade_database
from gateway.keys import KeyStore

MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start(args: argparse.Namespace, data: Path, port: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "SPECGATE_TARGET": str(args.target),
        "SPECGATE_DRAFT": str(args.draft),
        "SPECGATE_DEVICE": "cpu",
        "SPECGATE_DATA_DIR": str(data),
        "SPECGATE_DATABASE_URL": args.database_url,
        "SPECGATE_PORT": str(port),
        "SPECGATE_LOG_LEVEL": "warning",
    }
    specgate = Path(sys.executable).parent / "specgate"
    process = subprocess.Popen(
        [str(specgate), "serve"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("the gateway exited during startup")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("the gateway did not become ready")


def stream(base_url: str, key: str, model: str) -> None:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 200, "stream": True}
    try:
        with httpx.stream(
            "POST",
            base_url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
            timeout=60,
        ) as response:
            for _ in response.iter_lines():
                pass
    except httpx.HTTPError:
        pass  # the process was killed under it


def check(db: sa.Engine, signer: CheckpointSigner) -> dict[str, Any]:
    with db.connect() as connection:
        rows = connection.execute(
            sa.select(audit_events.c.event_id, audit_events.c.kind, audit_events.c.payload)
        ).all()
    requests = {row.event_id for row in rows if row.kind == "request"}
    ends = Counter(
        row.payload["request_event_id"] for row in rows if row.kind in ("completion", "interrupted")
    )
    return {
        "events": len(rows),
        "requests": len(requests),
        "interrupted": sum(1 for row in rows if row.kind == "interrupted"),
        "unanswered": len(requests - set(ends)),
        "answered_twice": sum(1 for count in ends.values() if count > 1),
        "chain_verifies": AuditLog(db, signer).verify().ok,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--model", default="target")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rng = random.Random(0)
    upgrade_database(args.database_url)
    db = make_db_engine(args.database_url)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="specgate-crash-") as scratch:
        data = Path(scratch)
        port = free_port()
        # The gateway starting on ``data`` loads this MAC key: its key rows and events carry it.
        mac = EventMac.load_or_create(data / "audit-mac-key")
        key = KeyStore(db, AuditLog(db, mac=mac)).create("app", f"crash-{os.getpid()}", "bench")[1]
        process = start(args, data, port)
        for _ in range(args.rounds):
            senders = [
                threading.Thread(target=stream, args=(f"http://127.0.0.1:{port}", key, args.model))
                for _ in range(args.streams)
            ]
            for sender in senders:
                sender.start()
            time.sleep(rng.uniform(0.2, 1.5))
            process.send_signal(signal.SIGKILL)
            process.wait(30)
            for sender in senders:
                sender.join(60)
            process = start(args, data, port)  # marks what the killed run left open
            signer = CheckpointSigner.load_or_create(data / "audit-signing-key.pem")
            rounds.append(check(db, signer))
        process.terminate()
        process.wait(60)
    db.dispose()
    result = {
        "rounds": rounds,
        "all_answered": all(r["unanswered"] == 0 and r["answered_twice"] == 0 for r in rounds),
        "all_verify": all(r["chain_verifies"] for r in rounds),
    }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
