"""Requests refused at admission (429 `queue_full`), in the audit log as counted summaries.

A refused request is never served, so it writes no `request` event; it is still a request
that reached the gateway with a valid key, and the log says so: one `refused` event per
window (``refusal_window_s``) with, per key and reason, how many were refused and when the
first and the last came. No prompt, no text, nothing the client chose beyond its key.

Why a summary and not an event per refusal: a 429 must stay cheap (it is the answer to
overload) and a flood of them must not become a flood of commits into the one append lock
the served requests need. Counting costs a dictionary update on the event loop; each window
costs one spooled event (one fsync on local disk, never a wait on the database), which the
spool's writer commits and retries like a `fallback` event. At most ``MAX_KEYS_LISTED`` keys
are listed per window; refusals of further keys are counted in ``unlisted_keys`` /
``unlisted_refusals``, so the total is always exact.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog

from gateway.spool import EventSpool

log = structlog.get_logger(__name__)

MAX_KEYS_LISTED = 256


@dataclass
class _Tally:
    count: int
    first_at: datetime
    last_at: datetime


class RefusalLog:
    def __init__(self, spool: EventSpool, *, model: str, instance_id: str, window_s: float) -> None:
        self._spool = spool
        self._model = model
        self._instance_id = instance_id
        self._window_s = window_s
        self._lock = threading.Lock()
        self._tallies: dict[tuple[str, str], _Tally] = {}
        self._unlisted_keys: set[str] = set()
        self._unlisted_refusals = 0
        self._window_start = datetime.now(UTC)
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None

    def count(self, key_id: str, reason: str) -> None:
        """Note one refusal; cheap, from any thread."""
        now = datetime.now(UTC)
        with self._lock:
            tally = self._tallies.get((key_id, reason))
            if tally is not None:
                tally.count += 1
                tally.last_at = now
            elif len(self._tallies) < MAX_KEYS_LISTED:
                self._tallies[(key_id, reason)] = _Tally(1, now, now)
            else:
                self._unlisted_keys.add(key_id)
                self._unlisted_refusals += 1

    def flush(self) -> int:
        """Spool one `refused` event for the refusals counted since the last flush, if any;
        returns how many it covers."""
        now = datetime.now(UTC)
        with self._lock:
            tallies, self._tallies = self._tallies, {}
            unlisted_keys, self._unlisted_keys = len(self._unlisted_keys), set()
            unlisted, self._unlisted_refusals = self._unlisted_refusals, 0
            start, self._window_start = self._window_start, now
        total = sum(t.count for t in tallies.values()) + unlisted
        if not total:
            return 0
        payload: dict[str, Any] = {
            "instance_id": self._instance_id,
            "model": self._model,
            "window_start": start.isoformat(),
            "window_end": now.isoformat(),
            "total": total,
            "refusals": [
                {
                    "key_id": key_id,
                    "reason": reason,
                    "count": tally.count,
                    "first_at": tally.first_at.isoformat(),
                    "last_at": tally.last_at.isoformat(),
                }
                for (key_id, reason), tally in sorted(tallies.items())
            ],
            "unlisted_keys": unlisted_keys,
            "unlisted_refusals": unlisted,
        }
        try:
            self._spool.enqueue("refused", "specgate", payload)
        except Exception:
            log.exception("refusals_not_recorded", total=total)
        return total

    def start(self) -> None:
        self._flusher = threading.Thread(target=self._run, name="specgate-refusals", daemon=True)
        self._flusher.start()

    def _run(self) -> None:
        while not self._stop.wait(self._window_s):
            self.flush()

    def close(self) -> None:
        """Stop the window timer and spool what is still counted."""
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join()
        self.flush()
