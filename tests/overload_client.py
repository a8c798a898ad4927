"""The overload test's client, run in its own process: on one machine a client that shares
the gateway's interpreter also shares its GIL, and its own waits would be counted as the
gateway's answer time."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx


def burst_then_probe(
    url: str, headers: dict[str, str], body: dict[str, Any], burst: int, probes: int
) -> dict[str, Any]:
    """Open ``burst`` streams at once and keep the admitted ones open; then send ``probes``
    more requests one at a time, timing each 429 from send to its whole body read.
    Returns the burst's statuses and Retry-After values, and the probes' 429 times (s)."""

    async def run() -> dict[str, Any]:
        limits = httpx.Limits(max_connections=burst + probes + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            admitted: list[httpx.Response] = []
            statuses: list[int] = []
            retry_after: list[str | None] = []

            async def one() -> None:
                request = client.build_request("POST", url, json=body, headers=headers)
                response = await client.send(request, stream=True)
                statuses.append(response.status_code)
                if response.status_code == 200:
                    admitted.append(response)
                else:
                    retry_after.append(response.headers.get("retry-after"))
                    await response.aread()
                    await response.aclose()

            await asyncio.gather(*(one() for _ in range(burst)))
            times: list[float] = []
            probe_statuses: list[int] = []
            probe_retry_after: list[str | None] = []
            for _ in range(probes):
                request = client.build_request("POST", url, json=body, headers=headers)
                started = time.perf_counter()
                response = await client.send(request, stream=True)
                probe_statuses.append(response.status_code)
                if response.status_code == 200:
                    # A stream finished and freed its slot meanwhile; holding this one keeps
                    # the queue full. It is not a 429 sample.
                    admitted.append(response)
                    continue
                await response.aread()
                times.append(time.perf_counter() - started)
                probe_retry_after.append(response.headers.get("retry-after"))
                await response.aclose()
            for response in admitted:
                await response.aclose()
            return {
                "statuses": statuses,
                "retry_after": retry_after,
                "probe_statuses": probe_statuses,
                "probe_retry_after": probe_retry_after,
                "probe_times_s": times,
            }

    return asyncio.run(run())
