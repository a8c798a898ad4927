"""Concurrency sweep through the live API: how the built-in engine's continuous batching
scales with concurrent clients, per speculation method.

    python -m bench.concurrency [--target DIR --draft DIR] [--clients 1,2,4,8,16]
                                [--methods none,ngram,draft] [--requests-per-client 2]
                                [--max-tokens 48] [--repeats 3] [--long-prompt-tokens 2000]
                                [--workload chat] [--dtype auto] [--vllm] [--json FILE]

The recommended run (about 11 minutes on a quiet 2-core machine, vLLM's startup included)::

    OMP_WAIT_POLICY=PASSIVE python -m bench.concurrency --draft ~/.cache/specgate/demo/draft \
        --clients 1,2,4,8,16 --methods none,ngram,draft --requests-per-client 2 \
        --max-tokens 32 --repeats 3 --long-prompt-tokens 2000 --vllm --json concurrency.json

Serves the real app (uvicorn on 127.0.0.1, scratch SQLite audit) and, for each number of
clients, runs that many streaming clients at once over a fixed mix (the built-in ``chat``
prompts in turn, or another ``--workload``), greedy so every method produces the same tokens,
once per method back to back. Per point: total completion tokens/s, mean per-request tokens/s,
p50/p99 latency and time to first token. ``--repeats N`` runs the whole sweep N times, the
methods' order rotated each time (so none of them always runs first, after the warm-up, or
last), and the verdict on "speculation never slower than plain" is per number of clients the
median over the repeats of the ratio method / plain tokens/s, each ratio from one repeat's
back-to-back points: a load that drifts moves both sides of a ratio alike, and one disturbed
point moves one ratio, not the median. After the sweep, the engine's speculation crossover per
method (the batch size at which a fresh batch stops speculating,
``specgate_speculation_crossover_batch_size`` in ``/metrics``). Then the head-of-line check: a
short request sent while a prompt of ``--long-prompt-tokens`` tokens is being prefilled, at
each of a few delays into that prefill; the median and the worst of its times to first token.
The 1-minute load average is reported with them.

``--vllm`` also starts vLLM's CPU build (``bench.vllm_server``, from ``.venv-vllm``) on the
target's weights, in the dtype the local engine serves them in (``--dtype``, by default the
engine's own choice, ``auto``), after the local app has stopped (the two never share the
cores), and runs the same clients over the same mix against it, plain decoding, as many
repeats: points with ``"server": "vllm"``, and per number of clients the median local plain
tokens/s over vLLM's. ``--vllm-methods none,ngram`` also runs a vLLM server with its n-gram
speculation (``bench.vllm_server.VLLM_NGRAM``: k 4, lookup 2-4) after the plain one, and the
summary ends with one table of median tokens/s by clients: the built-in engine's methods
beside vLLM's, the comparison with vLLM in one command::

    OMP_WAIT_POLICY=PASSIVE python -m bench.concurrency --clients 1,4,8 --methods none,ngram \
        --max-tokens 96 --repeats 3 --long-prompt-tokens 200 --vllm --vllm-methods none,ngram

vLLM runs without its prefix cache (``--no-enable-prefix-caching``)
unless ``--vllm-prefix-caching``: every client cycles through the same few prompts, so a
prefix cache skips most of vLLM's prefill work from the second request of a prompt on, and the
built-in engine has no prefix cache; like for like, neither side reuses another request's
cache. Another server plugs in instead of the local app with ``--base-url URL
--api-key KEY --model NAME``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from bench.gateway_overhead import serving
from bench.vllm_server import VLLM_SPECULATION, VllmServer, running
from bench.workload import BUILTIN_DIR
from engine.training.demo.paths import default_demo_dir
from gateway.settings import load_settings


@dataclass
class Point:
    server: str
    method: str
    clients: int
    repeat: int
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


WORKLOADS = ("chat", "code", "editing", "json", "mixed")


def prompt_mix(workload: str = "chat") -> list[list[dict[str, str]]]:
    """The built-in prompts of ``workload``; ``mixed``: chat and editing prompts in turn (some
    replies copy their prompt, others do not: each sequence of a batch speculates as its own
    proposals pay)."""
    if workload == "mixed":
        chat, editing = prompt_mix("chat"), prompt_mix("editing")
        return [m for pair in zip(chat, editing, strict=False) for m in pair]
    lines = (BUILTIN_DIR / f"{workload}.jsonl").read_text().splitlines()
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
    repeat: int,
    mix: list[list[dict[str, str]]],
) -> Point:

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
        repeat=repeat,
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


HEAD_OF_LINE_DELAYS_S = (0.05, 0.2, 0.35, 0.5, 0.65)


async def head_of_line(
    client: httpx.AsyncClient, model: str, long_tokens: int, delay_s: float
) -> float:
    """TTFT of a short request sent ``delay_s`` after one whose prompt has ``long_tokens``
    tokens (its prefill then in flight)."""
    # One token per word with the usual BPE vocabularies (the demo's "w12"-style words took
    # about three each, so a "2,000-token" prompt was 5,790 tokens).
    words = " ".join(["the"] * long_tokens)
    long_messages = [{"role": "user", "content": words}]
    short = [{"role": "user", "content": "Say hi."}]
    long_task = asyncio.create_task(one_request(client, model, long_messages, "none", 8))
    await asyncio.sleep(delay_s)
    timed = await one_request(client, model, short, "none", 8)
    await long_task
    return round(timed.ttft_s, 3)


async def heads_of_line(client: httpx.AsyncClient, model: str, long_tokens: int) -> list[float]:
    """``head_of_line`` once per delay of ``HEAD_OF_LINE_DELAYS_S``: where the short request
    lands in the long prompt's prefill changes what it waits for (a chunk pass just begun or
    nearly done), so one arrival time says little about the worst case."""
    return [
        await head_of_line(client, model, long_tokens, delay) for delay in HEAD_OF_LINE_DELAYS_S
    ]


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
        for method in methods:  # warm-up: every method's first request off the clock
            await one_request(client, server.model, prompt_mix(args.workload)[0], method, 4)
        for repeat in range(args.repeats):
            # Methods inner: each number of clients runs every method back to back, so their
            # ratio is measured side by side on a machine whose load drifts; the order turns
            # by one method per repeat.
            turn = repeat % len(methods)
            order = methods[turn:] + methods[:turn]
            for clients in (int(c) for c in args.clients.split(",")):
                for method in order:
                    point = await sweep_point(
                        client,
                        server.name,
                        server.model,
                        method,
                        clients,
                        args.requests_per_client,
                        args.max_tokens,
                        repeat,
                        prompt_mix(args.workload),
                    )
                    print(json.dumps(asdict(point)), flush=True)
                    points.append(point)
    return points


def _throughput(points: list[Point], method: str) -> dict[tuple[int, int], float]:
    """Total tokens/s by (clients, repeat) of one method's points."""
    return {(p.clients, p.repeat): p.total_tokens_per_s for p in points if p.method == method}


@dataclass
class Speedup:
    """One method against plain at one number of clients: each repeat's ratio of total
    tokens/s (back-to-back points) and their median."""

    ratios: list[float]
    median: float


def speedups(points: list[Point], baseline: str = "none") -> dict[str, dict[int, Speedup]]:
    """Per method besides ``baseline`` and per number of clients, its ``Speedup``."""
    plain = _throughput(points, baseline)
    found: dict[str, dict[int, Speedup]] = {}
    for method in sorted({p.method for p in points} - {baseline}):
        per_level: dict[int, list[float]] = {}
        for (clients, repeat), rate in sorted(_throughput(points, method).items()):
            base = plain.get((clients, repeat))
            if base:
                per_level.setdefault(clients, []).append(round(rate / base, 3))
        if per_level:
            found[method] = {
                clients: Speedup(ratios, round(statistics.median(ratios), 3))
                for clients, ratios in per_level.items()
            }
    return found


def never_slower(ratios: dict[str, dict[int, Speedup]]) -> dict[str, dict[str, object]]:
    """The goal's verdict per method: every number of clients has a median ratio of at least
    1 (the slowest such median is given either way)."""
    verdict: dict[str, dict[str, object]] = {}
    for method, levels in ratios.items():
        worst = min(levels, key=lambda clients: levels[clients].median)
        verdict[method] = {
            "never_slower": all(level.median >= 1.0 for level in levels.values()),
            "slowest_clients": worst,
            "slowest_median_ratio": levels[worst].median,
        }
    return verdict


def against_vllm(local: list[Point], vllm: list[Point]) -> dict[int, float]:
    """Per number of clients: the median of local plain tokens/s over the median of vLLM's."""
    ratios = {}
    for clients in sorted({p.clients for p in vllm}):
        ours = [p.total_tokens_per_s for p in local if p.method == "none" and p.clients == clients]
        theirs = [p.total_tokens_per_s for p in vllm if p.method == "none" and p.clients == clients]
        if ours and theirs:
            ratios[clients] = round(statistics.median(ours) / statistics.median(theirs), 3)
    return ratios


def summary(
    result: dict[str, object],
    ratios: dict[str, dict[int, Speedup]],
    versus_vllm: dict[int, float] | None,
) -> str:
    """The verdicts in a few lines: per method the median speedup over plain per number of
    clients, the crossover, and plain against vLLM where it ran."""
    lines = [f"load average (1 min) {result['load_average_1m']}, repeats {result['repeats']}"]
    crossover = result["speculation_crossover_batch_size"]
    assert isinstance(crossover, dict)
    for method, levels in ratios.items():
        medians = ", ".join(f"{c}: {level.median}x" for c, level in levels.items())
        slower = [c for c, level in levels.items() if level.median < 1.0]
        verdict = "never slower" if not slower else f"SLOWER at {slower} clients"
        lines.append(
            f"{method} / plain, median tokens/s by clients: {medians} ({verdict}; "
            f"crossover {crossover.get(method, 'n/a')})"
        )
    if versus_vllm is not None:
        shown = ", ".join(f"{c}: {r}x" for c, r in versus_vllm.items())
        lines.append(f"plain / vLLM ({result.get('vllm_dtype')}), median tokens/s: {shown}")
    ttft = result["short_request_ttft_behind_long_prompt_s"]
    assert isinstance(ttft, dict)
    lines.append(
        f"short request behind a {result['long_prompt_tokens']}-token prompt, sent "
        f"{len(ttft['by_delay_s'])} times at {', '.join(ttft['by_delay_s'])} s into its "
        f"prefill: first token after median {ttft['median']} s, at worst {ttft['max']} s"
    )
    return "\n".join(lines)


async def run(
    args: argparse.Namespace, server: Server
) -> tuple[dict[str, object], list[Point]]:
    """The sweep of ``server`` (every ``--methods``), its crossovers and head-of-line check;
    the report and the points."""
    points = await sweep(args, server, args.methods.split(","))
    async with client_for(server) as client:
        crossover = await crossovers(client)
        ttfts = await heads_of_line(client, server.model, args.long_prompt_tokens)
    ratios = speedups(points)
    return {
        "load_average_1m": round(os.getloadavg()[0], 2),
        "repeats": args.repeats,
        "points": [asdict(point) for point in points],
        "speedup_over_plain": {
            method: {str(c): asdict(level) for c, level in levels.items()}
            for method, levels in ratios.items()
        },
        "never_slower_than_plain": never_slower(ratios),
        "speculation_crossover_batch_size": crossover,
        "short_request_ttft_behind_long_prompt_s": {
            "median": statistics.median(ttfts),
            "max": max(ttfts),
            "by_delay_s": dict(zip(map(str, HEAD_OF_LINE_DELAYS_S), ttfts, strict=True)),
        },
        "long_prompt_tokens": args.long_prompt_tokens,
        "workload": args.workload,
    }, points


def vllm_sweep(
    args: argparse.Namespace, target: Path, dtype: str, scratch: Path
) -> tuple[dict[str, object], list[Point]]:
    """vLLM's CPU build on ``target``'s weights in ``dtype``, the same clients and mix: one
    server per ``--vllm-methods`` entry (``none``: plain; ``ngram``: its n-gram speculation),
    one after another, each point labelled with that method."""
    points: list[Point] = []
    runs: dict[str, dict[str, object]] = {}
    for method in args.vllm_methods.split(","):
        server = VllmServer(
            target, "bench-vllm", scratch / f"vllm-{method}.log", dtype=dtype,
            prefix_caching=args.vllm_prefix_caching,
            speculative_config=VLLM_SPECULATION[method],
        )
        if args.port:  # the port after the local app's
            server.port = args.port + 1
        with running(server):
            remote = Server("vllm", server.url, "none", "bench-vllm")
            served = asyncio.run(sweep(args, remote, ["default"]))
        points += [replace(point, method=method) for point in served]
        runs[method] = {
            "command": " ".join(server.command()[1:]),
            "startup_s": round(server.startup_s, 1),
            "load_average_1m": round(os.getloadavg()[0], 2),
        }
    return {
        "vllm_dtype": dtype,
        "vllm_prefix_caching": args.vllm_prefix_caching,
        "vllm_runs": runs,
        "vllm_points": [asdict(point) for point in points],
    }, points


def comparison_table(local: list[Point], vllm: list[Point]) -> str:
    """Median total tokens/s by number of clients: each local method beside each of vLLM's
    (a Markdown table)."""
    columns = [("Specgate", m, local) for m in dict.fromkeys(p.method for p in local)] + [
        ("vLLM", m, vllm) for m in dict.fromkeys(p.method for p in vllm)
    ]
    levels = sorted({p.clients for p in local} | {p.clients for p in vllm})
    lines = [
        "| tok/s | " + " | ".join(f"{c} clients" for c in levels) + " |",
        "|---|" + "---:|" * len(levels),
    ]
    for server, method, points in columns:
        cells = []
        for clients in levels:
            rates = [p.total_tokens_per_s for p in points
                     if p.method == method and p.clients == clients]  # fmt: skip
            cells.append(f"{statistics.median(rates):.1f}" if rates else "")
        lines.append(f"| {server} {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    parser.add_argument(
        "--repeats", type=int, default=1, help="sweeps, the methods' order rotated each time"
    )
    parser.add_argument(
        "--dtype", default="auto", help="the local engine's dtype; vLLM gets the one it serves"
    )
    parser.add_argument(
        "--workload", choices=WORKLOADS, default="chat", help="the built-in prompts sent"
    )
    parser.add_argument("--long-prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument(
        "--port", type=int, default=0, help="port of the local app, vLLM's the next (0: any)"
    )
    parser.add_argument(
        "--vllm", action="store_true", help="also sweep vLLM's CPU build on the same weights"
    )
    parser.add_argument(
        "--vllm-methods",
        default="none",
        help="vLLM servers to sweep one after another: none (plain), ngram",
    )
    parser.add_argument(
        "--vllm-prefix-caching",
        action="store_true",
        help="run vLLM with its prefix cache, as deployed (by default it is off, like for like)",
    )
    parser.add_argument("--base-url", help="bench another OpenAI server instead (e.g. vLLM)")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model", help="model name on --base-url")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()

    versus_vllm = None
    remote_points: list[Point] = []
    if args.base_url:
        remote = Server("remote", args.base_url, args.api_key, args.model)
        result, points = asyncio.run(run(args, remote))
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
                dtype=args.dtype,
            )
            with serving(settings, port=args.port) as (base_url, services):
                _, api_key = services.keys.create("app", "bench-concurrency", "bench")
                model = services.backend.card.model_name
                served = str(services.backend.engine.target_dtype).removeprefix("torch.")
                local = Server("specgate", base_url, api_key, model)
                result, points = asyncio.run(run(args, local))
                result["dtype"] = served
                services.keys.revoke("bench-concurrency", "bench")
            if args.vllm:  # after the local app has stopped: the two never share the cores
                target = args.target or default_demo_dir() / "target"
                remote_result, remote_points = vllm_sweep(args, target, served, Path(scratch))
                versus_vllm = against_vllm(points, remote_points)
                result |= remote_result
                result["plain_over_vllm"] = {str(c): r for c, r in versus_vllm.items()}
    print(json.dumps(result, indent=2))
    print(summary(result, speedups(points), versus_vllm))
    if remote_points:
        print(comparison_table(points, remote_points))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
