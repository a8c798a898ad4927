"""The overhead bench's client, in a process of its own, as a real client would be: one
keep-alive connection, one request per line read from stdin, one line of JSON written back.

    SPECGATE_BENCH_KEY=... python -m bench.loopback_client http://127.0.0.1:PORT

Each input line is a chat completion body; each output line gives ``sent`` and ``received``
(``time.perf_counter()``: CLOCK_MONOTONIC, the same clock as the serving process's stamps),
the status and the completion's token count. In the serving process the client's work would
compete for the GIL with the event loop it measures.
"""

from __future__ import annotations

import json
import os
import sys
import time

import httpx


def main() -> None:
    headers = {"authorization": f"Bearer {os.environ['SPECGATE_BENCH_KEY']}"}
    with httpx.Client(base_url=sys.argv[1], headers=headers, timeout=60) as client:
        for line in sys.stdin:
            body = json.loads(line)
            sent = time.perf_counter()
            response = client.post("/v1/chat/completions", json=body)
            received = time.perf_counter()
            ok = response.status_code == 200
            answer = {
                "sent": sent,
                "received": received,
                "status": response.status_code,
                "tokens": response.json()["usage"]["completion_tokens"] if ok else None,
            }
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
