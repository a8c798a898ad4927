"""What tracing costs a completion: the same requests with tracing off and on.

    python -m bench.tracing_overhead --target DIR [--draft DIR] [--requests 30] [--json FILE]

Each measurement runs in its own process, serving the real app in-process (Starlette's
TestClient: full middleware stack, lifespan, SQLite audit log in a scratch directory) and
sending the same greedy chat completion after a warm-up. With tracing on, spans go over
OTLP/HTTP to a receiver on 127.0.0.1 in that process; it stores the bodies and decodes them
only after the timing. Off and on alternate in rounds (off-on, on-off, ...) so that load
from other processes on the machine falls on both alike; the medians are over all requests.

A process per measurement, because an SDK tracer provider, once installed, stays for the
process: "off" measured after "on" in one process would still create (then drop) spans.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass
class ModeResult:
    mode: str
    requests: int
    median_ms: float
    p90_ms: float
    mean_ms: float
    cpu_ms_per_request: float
    spans_exported: int


class _Sink:
    """Stores OTLP/HTTP trace bodies; decoding waits until the timing is done."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.lock = threading.Lock()

    def span_count(self) -> int:
        with self.lock:
            bodies = list(self.bodies)
        return sum(
            len(scope.spans)
            for body in bodies
            for resource in ExportTraceServiceRequest.FromString(body).resource_spans
            for scope in resource.scope_spans
        )


@contextmanager
def otlp_sink() -> Iterator[tuple[str, _Sink]]:
    sink = _Sink()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with sink.lock:
                sink.bodies.append(body)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", sink
    finally:
        server.shutdown()
        server.server_close()


def measure(
    args: argparse.Namespace, scratch: Path, otlp_endpoint: str | None, sink: _Sink | None
) -> dict[str, Any]:
    """Wall milliseconds per request after the warm-up, the process CPU time of the timed
    requests (all threads, span export included), and the number of spans exported."""
    from fastapi.testclient import TestClient

    from gateway.app import create_app
    from gateway.settings import Settings

    data_dir = scratch / "data"
    settings = Settings(
        target=args.target,
        draft=args.draft,
        data_dir=data_dir,
        database_url=f"sqlite:///{data_dir}/audit.db",
        device=args.device,
        dtype="float32",
        otlp_endpoint=otlp_endpoint,
        log_level="warning",
    )
    body = {
        "model": args.target.name,
        "messages": [{"role": "user", "content": "def add(a, b):"}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "speculative": {"method": args.method} if args.method != "none" else False,
    }
    timings: list[float] = []
    app = create_app(settings)
    with TestClient(app) as client:
        _, key = app.state.services.keys.create("app", "bench", "bench")
        headers = {"authorization": f"Bearer {key}"}
        for _ in range(args.warmup):
            client.post("/v1/chat/completions", json=body, headers=headers).raise_for_status()
        cpu_started = time.process_time()
        for _ in range(args.requests):
            started = time.perf_counter()
            response = client.post("/v1/chat/completions", json=body, headers=headers)
            timings.append((time.perf_counter() - started) * 1000)
            response.raise_for_status()
        tracing = app.state.services.telemetry.tracing
        if tracing is not None:
            tracing.force_flush()
        cpu_ms = (time.process_time() - cpu_started) * 1000
    # Leaving the client ran the app's shutdown, which flushed every span to the sink.
    return {
        "timings_ms": timings,
        "cpu_ms": cpu_ms,
        "spans": sink.span_count() if sink is not None else 0,
    }


def run_worker(mode: str, args: argparse.Namespace) -> None:
    """One measurement in this process; prints the timings as JSON on stdout."""
    import torch

    from gateway.observability.logging import configure_logging

    # One intra-op thread: on a shared machine, spinning worker threads would blur CPU time.
    torch.set_num_threads(1)
    configure_logging(log_format="json", level="warning", stream=sys.stderr)
    with tempfile.TemporaryDirectory() as scratch_dir:
        if mode == "off":
            measured = measure(args, Path(scratch_dir), None, None)
        else:
            with otlp_sink() as (endpoint, sink):
                measured = measure(args, Path(scratch_dir), endpoint, sink)
    print(json.dumps(measured))


def run_round(mode: str, args: argparse.Namespace, requests: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.tracing_overhead", "--worker", mode]
    command += ["--target", str(args.target), "--method", args.method]
    command += ["--requests", str(requests), "--warmup", str(args.warmup)]
    command += ["--max-tokens", str(args.max_tokens), "--device", args.device]
    if args.draft is not None:
        command += ["--draft", str(args.draft)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def summarise(mode: str, timings: list[float], cpu_ms: float, spans: int) -> ModeResult:
    ordered = sorted(timings)
    return ModeResult(
        mode=mode,
        requests=len(ordered),
        median_ms=statistics.median(ordered),
        p90_ms=ordered[int(0.9 * (len(ordered) - 1))],
        mean_ms=statistics.fmean(ordered),
        cpu_ms_per_request=cpu_ms / len(ordered),
        spans_exported=spans,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--method", choices=["none", "ngram", "draft"], default="none")
    parser.add_argument("--requests", type=int, default=30, help="per mode, over all rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", choices=["off", "on"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker, args)
        return

    per_round = -(-args.requests // args.rounds)
    timings: dict[str, list[float]] = {"off": [], "on": []}
    spans = {"off": 0, "on": 0}
    cpu_ms = {"off": 0.0, "on": 0.0}
    for index in range(args.rounds):
        for mode in ("off", "on") if index % 2 == 0 else ("on", "off"):
            measured = run_round(mode, args, per_round)
            timings[mode] += measured["timings_ms"]
            spans[mode] += measured["spans"]
            cpu_ms[mode] += measured["cpu_ms"]
    off, on = (summarise(mode, timings[mode], cpu_ms[mode], spans[mode]) for mode in ("off", "on"))

    overhead_ms = on.median_ms - off.median_ms
    cpu_overhead_ms = on.cpu_ms_per_request - off.cpu_ms_per_request
    header = ("tracing", "requests", "median ms", "p90 ms", "mean ms", "cpu ms/req", "spans")
    widths = (7, 8, 10, 8, 8, 10, 6)
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for result in (off, on):
        print(
            f"{result.mode:>7} {result.requests:>8} {result.median_ms:>10.2f} "
            f"{result.p90_ms:>8.2f} {result.mean_ms:>8.2f} {result.cpu_ms_per_request:>10.2f} "
            f"{result.spans_exported:>6}"
        )
    print(
        f"overhead of tracing: median wall {overhead_ms:+.2f} ms "
        f"({100 * overhead_ms / off.median_ms:+.1f} %), "
        f"CPU {cpu_overhead_ms:+.2f} ms per request "
        f"({100 * cpu_overhead_ms / off.cpu_ms_per_request:+.1f} %)"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "results": [asdict(off), asdict(on)],
                    "overhead_ms": overhead_ms,
                    "cpu_overhead_ms": cpu_overhead_ms,
                    "max_tokens": args.max_tokens,
                    "method": args.method,
                    "rounds": args.rounds,
                }
            )
        )


if __name__ == "__main__":
    main()
