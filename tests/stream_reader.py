"""A streamed chat completion read on its own thread, and waiting for a condition: what the
outage and fault tests watch while they stall, stop or kill things."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx


class Stream:
    """A streaming request read on its own thread: records its chunks and how it ended."""

    def __init__(self, base_url: str, headers: dict[str, str], body: dict[str, Any]) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.done = False
        self.audit_id: str | None = None
        self.first_chunk = threading.Event()
        self.ended = threading.Event()
        self.ended_at = 0.0
        self._thread = threading.Thread(target=self._read, args=(base_url, headers, body))
        self._thread.start()

    def _read(self, base_url: str, headers: dict[str, str], body: dict[str, Any]) -> None:
        try:
            with httpx.stream(
                "POST", base_url + "/v1/chat/completions", json=body, headers=headers, timeout=120
            ) as response:
                self.audit_id = response.headers.get("x-specgate-audit-id")
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.chunks.append(json.loads(line[6:]))
                        self.first_chunk.set()
        except httpx.HTTPError:
            pass
        finally:
            self.ended_at = time.monotonic()
            self.first_chunk.set()
            self.ended.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def text(self) -> str:
        """The content the chunks carried (chat deltas)."""
        return "".join(
            choice.get("delta", {}).get("content") or ""
            for chunk in self.chunks
            for choice in chunk.get("choices", [])
        )

    @property
    def error(self) -> dict[str, Any] | None:
        last = self.chunks[-1] if self.chunks else {}
        return last.get("error")


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``condition`` every 0.1 s; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
