"""CPU time per request: the gateway's, and what a gateway request costs the vLLM server.

    python -m bench.vllm_cpu [--target DIR] [--concurrency 16] [--requests 32]
                             [--max-tokens 32] [--rounds 2] [--port-base N]

On a shared machine latencies drift with the load; CPU seconds much less. This starts one
plain vLLM server on the demo target and, in this process, two gateways in front of it: one
given only the model's version (the prompt's text from the server's ``/detokenize``) and one
also given its directory (``model_dir``: the text decoded beside the gateway,
``gateway.backends.vllm_tokenizer``). Rounds alternate vLLM direct and the two gateways, the
same greedy chat requests each. Per request it reports the CPU time of this process (the
load generator, plus the gateway's threads on the gateway routes: the gateway's own is the
difference to the direct route), of vLLM's API server process, and of its other processes
(the engine core), read from ``/proc``. First it prices the calls the gateway makes besides
the generation: ``/tokenize`` of a chat and ``/detokenize``, on the API server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from bench.vllm_server import VllmServer, running
from bench.vllm_side_by_side import PROMPTS, Route, gateway_route, level
from engine.models.versioning import model_version
from gateway.settings import DEMO_MODEL_NAME, BackendSettings, Settings

CALLS = 64


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU seconds of ``pids`` so far (those that have exited count 0)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def process_group(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-g", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port-base", type=int, default=0, help="default: free ports")
    args = parser.parse_args()
    from engine.training.demo.paths import default_demo_dir

    target = args.target or default_demo_dir() / "target"
    scratch = Path(tempfile.mkdtemp(prefix="specgate-vllm-cpu-"))
    ports = {"port": args.port_base} if args.port_base else {}
    server = VllmServer(target, DEMO_MODEL_NAME, scratch / "vllm.log", max_model_len=2048, **ports)
    with running(server):
        assert server.process is not None
        api = [server.process.pid]
        engine = [p for p in process_group(server.process.pid) if p not in api]
        prompts = [json.loads(line)["messages"] for line in PROMPTS.read_text().splitlines()]
        body = {"model": DEMO_MODEL_NAME, "messages": prompts[0], "add_generation_prompt": True}
        tokens = httpx.post(f"{server.url}/tokenize", json=body, timeout=60).json()["tokens"]
        for name, path, call in [
            ("/tokenize (chat)", "/tokenize", body),
            ("/detokenize", "/detokenize", {"model": DEMO_MODEL_NAME, "tokens": tokens}),
        ]:
            before = cpu_seconds(api)
            with httpx.Client(timeout=60) as client:
                for _ in range(CALLS):
                    client.post(server.url + path, json=call).raise_for_status()
            used = (cpu_seconds(api) - before) / CALLS
            print(json.dumps({"call": name, "api_server_cpu_ms": round(used * 1e3, 2)}))

        def settings(name: str, with_dir: bool) -> Settings:
            entry: dict[str, object] = {"url": server.url, "model_version": model_version(target)}
            if with_dir:
                entry["model_dir"] = target
            backend: dict[str, Any] = {"kind": "vllm", "vllm_servers": [entry]}
            return Settings(backend=BackendSettings.model_validate(backend),
                            database_url=f"sqlite:///{scratch}/{name}.db", data_dir=scratch / name,
                            log_format="console", log_level="warning")  # fmt: skip

        with ExitStack() as stack:
            first = args.port_base + 1 if args.port_base else 0
            routes = [
                Route("vllm direct", server.url, {}, DEMO_MODEL_NAME, {}, True),
                gateway_route(
                    stack, "gateway, server /detokenize", settings("server", False), {}, first
                ),
                gateway_route(
                    stack,
                    "gateway, model_dir tokenizer",
                    settings("local", True),
                    {},
                    first + 1 if first else 0,
                ),
            ]
            for route in routes[1:]:  # warm
                asyncio.run(level(route, prompts, args.concurrency, args.concurrency, 8))
            for round_ in range(args.rounds):
                for route in routes:
                    this, api_before, engine_before = (
                        time.process_time(), cpu_seconds(api), cpu_seconds(engine)
                    )  # fmt: skip
                    row = asyncio.run(
                        level(route, prompts, args.concurrency, args.requests, args.max_tokens)
                    )
                    per = 1e3 / args.requests
                    print(json.dumps({
                        "round": round_,
                        "route": route.name,
                        "this_process_cpu_ms": round((time.process_time() - this) * per, 2),
                        "vllm_api_server_cpu_ms": round((cpu_seconds(api) - api_before) * per, 2),
                        "vllm_engine_cpu_ms": round((cpu_seconds(engine) - engine_before) * per, 1),
                        "p50_ms": row.p50_ms,
                        "errors": row.errors,
                        "load_average_1m": row.load_average_1m,
                    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
