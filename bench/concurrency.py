"""Concurrency sweep through the live API: how the built-in engine's continuous batching
scales with concurrent clients, per speculation method.

    python -m bench.concurrency [--target DIR --draft DIR] [--clients 1,2,4,8,16]
                                [--methods none,ngram,draft] [--requests-per-client 2]
                                [--max-tokens 48] [--long-prompt-tokens 2000] [--json FILE]

Serves the real app (uvicorn on 127.0.0.1, scratch SQLite audit) and, for each method and
each number of clients, runs that many streaming clients at once over a fixed mix (the
built-in ``chat`` prompts, in turn), greedy so every method produces the same tokens. Per
point: total completion tokens/s, mean per-request tokens/s, p50/p99 latency and time to
first token. After the sweep, the engine's speculation crossover per method (the batch size
at which it stops speculating, ``specgate_speculation_crossover_batch_size`` in ``/metrics``).
Then the head-of-line check: one short request sent while a prompt of
``--long-prompt-tokens`` tokens is being prefilled; its time to first token. Points run in
one process, side by side; the 1-minute load average is reported with them.

``--vllm`` also starts vLLM's CPU build (``bench.vllm_server``, from ``.venv-vllm``) on the
target's weights and runs the same clients over the same mix against it, plain decoding, in
the same run after the local sweep: points with ``"server": "vllm"`` beside the local ones.
Another server plugs in instead of the local app with ``--base-url URL --api-key KEY --model
NAME``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.gateway_overhead import serving
from bench.vllm_server import VllmServer
from bench.workload import BUILTIN_DIR
from engine.demo.paths import default_demo_dir
from gateway.settings import load_settings


@dataclass
class Point:
    server: str
    method: str
    clients: int
    requests: int
    total_tokens_per_s: float
    per_request_tokens_per_s: float
    p50_latency_s: float
    p99_latency_s: float
    p50_ttft_s: float
    p99_ttft_s: float


@dataclass
class Timed:
    tokens: int
    latency_s: float
    ttft_s: float


def chat_mix() -> list[list[dict[str, str]]]:
    lines = (BUILTIN_DIR / "chat.jsonl").read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines if line.strip()]


async def one_request(
    client: httpx.AsyncClient,
    model: str,
    messages: list[dict[str, str]],
    method: str,
    max_tokens: int,
) -> Timed:
    body: dict[str, object] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if method != "default":
        body["speculative"] = False if method == "none" else {"method": method}
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if first is None and any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                first = time.perf_counter()
    done = time.perf_counter()
    return Timed(tokens, done - started, (first or done) - started)


def _p(values: list[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(sorted(values), n=100, method="inclusive")[q - 1]


async def sweep_point(
    client: httpx.AsyncClient,
    server: str,
    model: str,
    method: str,
    clients: int,
    per_client: int,
    max_tokens: int,
) -> Point:
    mix = chat_mix()

    async def run_client(index: int) -> list[Timed]:
        out = []
        for n in range(per_client):
            messages = mix[(index * per_client + n) % len(mix)]
            out.append(await one_request(client, model, messages, method, max_tokens))
        return out

    started = time.perf_counter()
    results = [t for batch in await asyncio.gather(*map(run_client, range(clients))) for t in batch]
    wall = time.perf_counter() - started
    latencies = [t.latency_s for t in results]
    ttfts = [t.ttft_s for t in results]
    return Point(
        server=server,
        method=method,
        clients=clients,
        requests=len(results),
        total_tokens_per_s=round(sum(t.tokens for t in results) / wall, 2),
        per_request_tokens_per_s=round(
            statistics.fmean(t.tokens / t.latency_s for t in results), 2
        ),
        p50_latency_s=round(_p(latencies, 50), 3),
        p99_latency_s=round(_p(latencies, 99), 3),
        p50_ttft_s=round(_p(ttfts, 50), 3),
        p99_ttft_s=round(_p(ttfts, 99), 3),
    )


async def head_of_line(client: httpx.AsyncClient, model: str, long_tokens: int) -> float:
    """TTFT of a short request sent just after one whose prompt has ``long_tokens`` tokens."""
    # One token per word with the usual BPE vocabularies (the demo's "w12"-style words took
    # about three each, so a "2,000-token" prompt was 5,790 tokens).
    words = " ".join(["the"] * long_tokens)
    long_messages = [{"role": "user", "content": words}]
    short = [{"role": "user", "content": "Say hi."}]
    long_task = asyncio.create_task(one_request(client, model, long_messages, "none", 8))
    await asyncio.sleep(0.05)
    timed = await one_request(client, model, short, "none", 8)
    await long_task
    return round(timed.ttft_s, 3)


CROSSOVER_GAUGE = "specgate_speculation_crossover_batch_size"


async def crossovers(client: httpx.AsyncClient) -> dict[str, float | str]:
    """The engine's speculation crossover per method, as ``/metrics`` reports it (absent
    on another server, such as vLLM)."""
    response = await client.get("/metrics")
    if response.status_code != 200:
        return {}
    found: dict[str, float | str] = {}
    for line in response.text.splitlines():
        if line.startswith(CROSSOVER_GAUGE + "{"):
            labels, value = line[len(CROSSOVER_GAUGE) + 1 :].rsplit("} ", 1)
            method = next(
                part.split("=", 1)[1].strip('"')
                for part in labels.split(",")
                if part.startswith("method=")
            )
            number = float(value)
            found[method] = number if number != float("inf") else "inf"
    return found


@dataclass(frozen=True)
class Server:
    """An OpenAI server to sweep: its label in the report, where it listens, what it serves."""

    name: str
    base_url: str
    api_key: str
    model: str


def client_for(server: Server) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {server.api_key}"}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    return httpx.AsyncClient(
        base_url=server.base_url, headers=headers, timeout=600, limits=limits
    )


async def sweep(args: argparse.Namespace, server: Server, methods: list[str]) -> list[Point]:
    points = []
    async with client_for(server) as client:
        await one_request(client, server.model, chat_mix()[0], methods[0], 4)  # warm-up
        # Methods inner: each number of clients runs every method back to back, so their
        # ratio is measured side by side on a machine whose load drifts.
        for clients in (int(c) for c in args.clients.split(",")):
            for method in methods:
                point = await sweep_point(
                    client,
                    server.name,
                    server.model,
                    method,
                    clients,
                    args.requests_per_client,
                    args.max_tokens,
                )
                print(json.dumps(asdict(point)), flush=True)
                points.append(point)
    return points


async def run(args: argparse.Namespace, server: Server) -> dict[str, object]:
    """The sweep of ``server`` (every ``--methods``), its crossovers and head-of-line check."""
    points = await sweep(args, server, args.methods.split(","))
    async with client_for(server) as client:
        crossover = await crossovers(client)
        ttft = await head_of_line(client, server.model, args.long_prompt_tokens)
    return {
        "load_average_1m": round(os.getloadavg()[0], 2),
        "points": [asdict(point) for point in points],
        "speculation_crossover_batch_size": crossover,
        "short_request_ttft_behind_long_prompt_s": ttft,
        "long_prompt_tokens": args.long_prompt_tokens,
    }


def vllm_sweep(args: argparse.Namespace, target: Path, scratch: Path) -> dict[str, object]:
    """vLLM's CPU build on ``target``'s weights, the same clients and mix, plain decoding."""
    server = VllmServer(target, "bench-vllm", scratch / "vllm.log")
    if args.port:  # the port after the local app's
        server.port = args.port + 1
    server.start()
    try:
        server.wait_ready()
        remote = Server("vllm", server.url, "none", "bench-vllm")
        points = asyncio.run(sweep(args, remote, ["default"]))
    finally:
        server.stop()
    return {
        "vllm_command": " ".join(server.command()[1:]),
        "vllm_startup_s": round(server.startup_s, 1),
        "vllm_load_average_1m": round(os.getloadavg()[0], 2),
        "vllm_points": [asdict(point) for point in points],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path)
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--clients", default="1,2,4,8,16")
    parser.add_argument("--methods", default="none,ngram,draft")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--long-prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument(
        "--port", type=int, default=0, help="port of the local app, vLLM's the next (0: any)"
    )
    parser.add_argument(
        "--vllm", action="store_true", help="also sweep vLLM's CPU build on the same weights"
    )
    parser.add_argument("--base-url", help="bench another OpenAI server instead (e.g. vLLM)")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model", help="model name on --base-url")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()

    if args.base_url:
        result = asyncio.run(run(args, Server("remote", args.base_url, args.api_key, args.model)))
    else:
        with tempfile.TemporaryDirectory(prefix="specgate-concurrency-") as scratch:
            settings = load_settings(
                target=args.target,
                draft=args.draft,
                database_url=f"sqlite:///{scratch}/audit.db",
                data_dir=Path(scratch),
                checkpoint_interval_s=3600.0,
                log_level="warning",
                max_num_seqs=args.max_num_seqs,
                max_queue=256,
            )
            with serving(settings, port=args.port) as (base_url, services):
                _, api_key = services.keys.create("app", "bench-concurrency", "bench")
                model = services.backend.card.model_name
                result = asyncio.run(run(args, Server("specgate", base_url, api_key, model)))
                services.keys.revoke("bench-concurrency", "bench")
            if args.vllm:  # after the local app has stopped: the two never share the cores
                target = args.target or default_demo_dir() / "target"
                result |= vllm_sweep(args, target, Path(scratch))
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
