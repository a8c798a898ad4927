"""The built-in engine and vLLM (CPU) behind the same gateway, side by side in one run.

    python -m bench.vllm_side_by_side [--target DIR] [--draft DIR | --no-draft]
                                      [--no-engine] [--pin] [--port-base N]
                                      [--concurrency 1 4 16] [--max-tokens 32]
                                      [--requests-per-level 16] [--repeats 3]
                                      [--json FILE]

Starts vLLM servers on the demo target in float32: one plain, one with n-gram speculation
and, when the demo draft is built (or ``--draft`` names one sharing the target's
vocabulary), one with vLLM's ``draft_model`` speculation on it (docs/vllm.md). Then, at each
concurrency, it sends the same greedy chat requests (the code prompts) through:

- the gateway over the built-in engine, plain, n-gram and draft;
- the gateway over the vLLM servers, plain (``speculative: false``), n-gram and draft;
- vLLM directly (its own ``/v1/chat/completions``), plain, n-gram and draft.

``--no-engine`` leaves the built-in engine's rows out (the gateway's added latency over vLLM
needs only the vLLM pairs, and the built-in engine at 16 clients is most of the run's time).

The gateways run with the fallback off (``acceptance_threshold`` 0), so that every route
is served by the pool it names. The gateway reads the draft's version from the ``specgate
models hash`` manifest beside it, which the bench writes when it is missing (as an operator
would). They are given the target's directory as ``model_dir`` besides its version, so
they decode the rendered chat prompt with the model's tokenizer (``gateway.backends.
vllm_tokenizer``) instead of asking the server's ``/detokenize``, as an operator who mounts
the weights beside the gateway gets.

Where the processes run. Each gateway runs in a process of its own (``specgate serve``'s
app under uvicorn, started by ``multiprocessing``), as it is deployed: it shares no GIL with
the load generator. Its audit store is SQLite in its data directory, or, with ``--postgres
URL`` (e.g. ``postgresql://postgres@127.0.0.1:5432``), a fresh PostgreSQL database per
gateway, migrated before it starts and dropped after. By default every process shares every
CPU: every CPU cycle a gateway spends is then taken from vLLM, and the added latency counts
the gateway's CPU twice (its own time and vLLM's lost time). With ``--pin`` the vLLM servers
run on CPU 0 (``taskset -c 0``: the API server, the engine core and its OpenMP threads) and
the gateways and the load generator on CPU 1, approximating the production layout where the
gateway has a pod of its own; vLLM direct is measured under the same pinning, so the pair
still differs only by the gateway. On a 2-CPU machine pinning halves vLLM's CPUs, so its
pinned latencies are not comparable with the unpinned ones: compare each run's added
latency, not its seconds. PostgreSQL (a system service) is not pinned.

The vLLM servers run without prefix caching: a pair sends the same prompts twice, and a
cache warmed by the first route would favour the second. Within a pair the order alternates
from one repeat to the next (gateway first, then vLLM direct first), so whatever else one
run leaves behind for the next falls on both sides alike. Before each concurrency's rounds,
every route serves one unmeasured batch at that concurrency: the first batch of a new size
costs more, and without it that cost fell on the first route of the first round (docs/vllm.md:
+30-40 % for the gateway at 16 clients, then -4 % to +2 % in the next round).

It reports tokens/s (all completion tokens over the level's wall time), p50/p99 request
latency, the acceptance rate, and the gateway's added latency over calling vLLM directly
(p50 through the gateway over p50 direct, same server, same concurrency). Routes alternate
level by level, for ``--repeats`` rounds, each route through the gateway to a vLLM server next
to the same server directly, so drift hits a pair alike; the added latency is the median
of the pairs' ratios, and the load average is reported with every level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx

from bench.audit_bench import scratch_database
from bench.gateway_overhead import serving
from bench.vllm_server import VLLM_NGRAM, VllmServer, running
from engine.models.versioning import MANIFEST_NAME, model_version, write_manifest
from gateway.settings import DEMO_MODEL_NAME, BackendSettings, Settings, VllmServerSettings

PROMPTS = Path(__file__).parent / "prompts" / "code.jsonl"
NUM_DRAFT_TOKENS = 4


def draft_config(draft: Path) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for a draft model (it must share the vocabulary)."""
    return {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": NUM_DRAFT_TOKENS,
    }


@dataclass
class Row:
    route: str
    concurrency: int
    requests: int
    errors: int
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    acceptance_rate: float | None
    repeat: int = 0
    load_average_1m: float = 0.0


def added_latency(rows: list[Row], pools: list[str], levels: list[int]) -> dict[str, float]:
    """Per pool and concurrency, the median over repeats of p50 through the gateway over p50
    direct (same server, same repeat) minus one."""
    by = {(r.route, r.concurrency, r.repeat): r for r in rows}
    added: dict[str, float] = {}
    for pool in pools:
        for c in levels:
            ratios = [
                by[(f"gateway+vllm {pool}", c, r)].p50_ms / by[(f"vllm direct {pool}", c, r)].p50_ms
                for (name, level_c, r) in by
                if name == f"vllm direct {pool}" and level_c == c
            ]
            added[f"{pool} c={c}"] = round(statistics.median(ratios) - 1, 4)
    return added


@dataclass(frozen=True)
class Route:
    name: str
    url: str
    headers: dict[str, str]
    model: str
    extra: dict[str, Any]
    direct: bool


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1]


async def one(client: httpx.AsyncClient, route: Route, messages: list[dict[str, str]],
              max_tokens: int) -> tuple[float, int, int, int]:  # fmt: skip
    body = {"model": route.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, **route.extra}  # fmt: skip
    started = time.perf_counter()
    reply = await client.post(f"{route.url}/v1/chat/completions", json=body, headers=route.headers)
    elapsed = time.perf_counter() - started
    if reply.status_code != 200:  # e.g. 503 audit_unavailable: counted, not timed
        return elapsed, -1, 0, 0
    data = reply.json()
    if route.direct:
        spec = (data.get("metrics") or {}).get("speculative_decoding") or {}
        drafted = spec.get("num_draft_tokens", 0)
        accepted = spec.get("num_accepted_draft_tokens", 0)
    else:
        spec = data.get("speculative") or {}
        drafted, accepted = spec.get("num_draft_tokens", 0), spec.get("num_accepted_tokens", 0)
    return elapsed, int(data["usage"]["completion_tokens"]), int(drafted), int(accepted)


async def level(route: Route, prompts: list[list[dict[str, str]]], concurrency: int,
                requests: int, max_tokens: int) -> Row:  # fmt: skip
    queue = [prompts[i % len(prompts)] for i in range(requests)]
    results: list[tuple[float, int, int, int]] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            while queue:
                results.append(await one(client, route, queue.pop(), max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    errors = sum(1 for r in results if r[1] < 0)
    results = [r for r in results if r[1] >= 0] or [(wall, 0, 0, 0)]
    latencies = [r[0] for r in results]
    drafted = sum(r[2] for r in results)
    return Row(
        route=route.name,
        concurrency=concurrency,
        requests=len(results),
        errors=errors,
        tokens_per_s=round(sum(r[1] for r in results) / wall, 2),
        p50_ms=round(statistics.median(latencies) * 1e3, 1),
        p99_ms=round(percentile(latencies, 99) * 1e3, 1),
        acceptance_rate=round(sum(r[3] for r in results) / drafted, 3) if drafted else None,
        load_average_1m=round(os.getloadavg()[0], 2),
    )


# --pin: the vLLM servers on the first CPU, this process (the load generator) and the gateways'
# processes on the second.
VLLM_CPUS, GATEWAY_CPUS = "0", {1}


def pin_this_process() -> None:
    """This process (the load generator), and every thread it starts from now on, on
    ``GATEWAY_CPUS``."""
    os.sched_setaffinity(0, GATEWAY_CPUS)


@contextmanager
def vllm_servers(
    target: Path, logs: Path, draft: Path | None, cpus: str | None, port_base: int
) -> Iterator[dict[str, VllmServer]]:
    """The servers by speculation method ("plain", "ngram", and "draft" with a draft), started
    side by side, on ``cpus`` (None: all), on ports from ``port_base`` (0: free ones)."""
    configs: dict[str, dict[str, Any] | None] = {"plain": None, "ngram": VLLM_NGRAM}
    if draft is not None:
        configs["draft"] = draft_config(draft)
    ports = {name: {"port": port_base + i} if port_base else {} for i, name in enumerate(configs)}
    servers = {
        name: VllmServer(
            target,
            DEMO_MODEL_NAME,
            logs / f"{name}.log",
            speculative_config=config,
            max_model_len=2048,
            cpus=cpus,
            prefix_caching=False,
            **ports[name],  # type: ignore[arg-type]
        )
        for name, config in configs.items()
    }
    with running(*servers.values()):
        yield servers


def _serve_gateway(
    settings: Settings, name: str, port: int, cpus: set[int] | None, conn: Connection
) -> None:
    """In the gateway's own process: serve, send (url, app key) back, serve until told."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    with serving(settings, port=port) as (url, services):
        conn.send((url, services.keys.create("app", f"bench-{name}", "bench")[1]))
        conn.recv()


@contextmanager
def gateway_process(
    settings: Settings, name: str, port: int, cpus: set[int] | None
) -> Iterator[tuple[str, str]]:
    """A gateway serving ``settings`` in a process of its own: its URL and an app key."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(
        target=_serve_gateway, args=(settings, name, port, cpus, theirs), daemon=True
    )
    process.start()
    try:
        if not ours.poll(600):
            raise RuntimeError(f"the gateway for {name} did not start")
        url, key = ours.recv()
        yield url, key
    finally:
        if process.is_alive():
            ours.send("stop")
            process.join(timeout=30)
        if process.is_alive():
            process.terminate()


def gateway_route(
    stack: ExitStack,
    name: str,
    settings: Settings,
    extra: dict[str, Any],
    port: int,
    cpus: set[int] | None,
) -> Route:
    url, key = stack.enter_context(gateway_process(settings, name, port, cpus))
    return Route(name, url, {"authorization": f"Bearer {key}"}, DEMO_MODEL_NAME, extra, False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--draft", type=Path, default=None, help="default: the demo draft")
    parser.add_argument("--no-draft", action="store_true", help="no draft rows")
    parser.add_argument("--no-engine", action="store_true", help="no built-in engine rows")
    parser.add_argument(
        "--pin", action="store_true", help="vLLM on CPU 0, the gateways and load generator on CPU 1"
    )
    parser.add_argument(
        "--port-base", type=int, default=0, help="servers on ports from N up (default: free)"
    )
    parser.add_argument(
        "--postgres",
        default=None,
        help="a PostgreSQL server URL: a fresh database per gateway (default: SQLite)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests-per-level", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every route")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.pin:
        pin_this_process()  # before any thread starts
    from engine.training.demo.paths import default_demo_dir

    target = args.target or default_demo_dir() / "target"
    draft = None if args.no_draft else args.draft or default_demo_dir() / "draft"
    if draft is not None and not (draft / "config.json").is_file():
        print(f"no draft at {draft}: no draft rows", flush=True)
        draft = None
    if draft is not None and not (draft / MANIFEST_NAME).is_file():
        write_manifest(draft)  # `specgate models hash DRAFT`: the vLLM backend reads it
    prompts = [json.loads(line)["messages"] for line in PROMPTS.read_text().splitlines()]
    scratch = Path(tempfile.mkdtemp(prefix="specgate-vllm-bench-"))
    version = model_version(target)  # what the operator would give the vLLM backend
    cpus = VLLM_CPUS if args.pin else None
    with (
        vllm_servers(target, scratch, draft, cpus, args.port_base) as servers,
        ExitStack() as stack,
    ):
        # The fallback is off: each route measures the pool it names. With it on, a gateway
        # whose n-gram acceptance dipped under the threshold would serve its "ngram" route
        # from the plain pool, and the added latency would compare plain against n-gram.
        common: dict[str, Any] = {
            "log_format": "console",
            "log_level": "warning",
            "acceptance_threshold": 0.0,
        }

        def store(name: str) -> str:
            if args.postgres is None:
                return f"sqlite:///{scratch}/{name}.db"
            return stack.enter_context(scratch_database(args.postgres, "postgres"))

        def local(name: str, **speculation: Any) -> Settings:
            return Settings(target=target, served_model_name=DEMO_MODEL_NAME, dtype="float32",
                            device="cpu", database_url=store(name), data_dir=scratch / name,
                            **speculation, **common)  # fmt: skip

        # One engine, two routes.
        local_ngram = local("local", speculative_config=json.dumps(VLLM_NGRAM))
        plain = servers["plain"]

        def remote(name: str, method: str) -> Settings:
            speculative = servers[method]
            return Settings(
                backend=BackendSettings(
                    kind="vllm",
                    vllm_servers=[
                        VllmServerSettings(url=plain.url, model_version=version, model_dir=target),
                        VllmServerSettings(
                            url=speculative.url,
                            model_version=version,
                            model_dir=target,
                            speculative_config=speculative.speculative_config,
                        ),
                    ],
                ),
                database_url=store(name),
                data_dir=scratch / name,
                **common,
            )

        # One gateway (and audit store) per route, each on its own port from after the
        # servers' (0: a free one).
        planned: list[tuple[str, Callable[[], Settings], dict[str, Any]]] = []
        if not args.no_engine:
            planned += [
                ("gateway+engine plain", lambda: local_ngram, {"speculative": False}),
                ("gateway+engine ngram", lambda: local_ngram, {}),
            ]
        planned += [
            ("gateway+vllm plain", lambda: remote("vllm-plain", "ngram"), {"speculative": False}),
            ("gateway+vllm ngram", lambda: remote("vllm-ngram", "ngram"), {}),
        ]
        if draft is not None:
            if not args.no_engine:
                planned.append(
                    ("gateway+engine draft", lambda: local("local-draft", draft=draft), {})
                )
            planned.append(("gateway+vllm draft", lambda: remote("vllm-draft", "draft"), {}))
        first_port = args.port_base + len(servers) if args.port_base else 0
        gateway_cpus = GATEWAY_CPUS if args.pin else None
        routes = [
            gateway_route(
                stack, name, settings(), extra, first_port + i if first_port else 0, gateway_cpus
            )
            for i, (name, settings, extra) in enumerate(planned)
        ]
        direct = {
            name: Route(f"vllm direct {name}", server.url, {}, DEMO_MODEL_NAME, {}, True)
            for name, server in servers.items()
        }
        # Each gateway+vllm route runs next to vLLM direct on the same server, so a pair sees
        # the same load, first the gateway then vLLM in even repeats and the other way round
        # in odd ones; the added latency is the median of the pairs' ratios.
        pairs: list[list[Route]] = []
        for route in routes:
            pool = route.name.removeprefix("gateway+vllm ")
            pairs.append([route, direct.pop(pool)] if pool in direct else [route])
        pairs += [[route] for route in direct.values()]
        # One unmeasured request through every route first: a gateway's first request pays
        # for what its process has not done yet (imports, connections, the tokenizer probe).
        for pair in pairs:
            for route in pair:
                asyncio.run(level(route, prompts, 1, 1, args.max_tokens))
        rows: list[Row] = []
        for concurrency in args.concurrency:
            requests = max(args.requests_per_level, concurrency)
            # Unmeasured, every route at this concurrency first: the first batch of a new size
            # costs more, on vLLM (new shapes) and in a gateway (connections and threads its
            # pools open), and would fall on whichever route came first.
            for route in [r for pair in pairs for r in pair]:
                asyncio.run(level(route, prompts, concurrency, concurrency, args.max_tokens))
            for repeat in range(args.repeats):
                ordered = [r for pair in pairs for r in (pair if repeat % 2 == 0 else pair[::-1])]
                for route in ordered:
                    row = asyncio.run(level(route, prompts, concurrency, requests, args.max_tokens))
                    row.repeat = repeat
                    rows.append(row)
                    print(json.dumps(asdict(row)), flush=True)
    added = added_latency(rows, list(servers), args.concurrency)
    report = {
        "load_average_1m": os.getloadavg()[0],
        "pinned": {"vllm_cpus": VLLM_CPUS, "gateway_cpus": sorted(GATEWAY_CPUS)}
        if args.pin
        else None,
        "max_tokens": args.max_tokens,
        "startup_s": {f"vllm_{name}": server.startup_s for name, server in servers.items()},
        "rows": [asdict(r) for r in rows],
        "gateway_added_p50_fraction": added,
    }
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
