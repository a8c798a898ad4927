"""Re-verification of the stored history on a schedule (``audit_reverify_period_s``).

A checkpoint checks only the events after the last one this gateway signed; an old row
edited in place is otherwise found only when someone asks (``/v1/audit/verify``). The sweep
walks the whole signed history again, a slice at a time, with the checks of the offline
verifier (sequence, chain, hash, MAC, the legacy prefix) and, at its end, the root of the
checkpoint it started from. Each slice is one read transaction of at most ``max_events``
events: the period is spread over many small reads, never one long one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from gateway.audit.canonical import GENESIS_HASH
from gateway.audit.legacy import LegacyPrefix
from gateway.audit.mac import EventMac
from gateway.audit.merkle import CompactRange, leaf_hash
from gateway.audit.records import EventRecord
from gateway.audit.schema import audit_events
from gateway.audit.verify import event_problem

Problem = tuple[int | None, str]
# An ``audit_events`` row to its record (``gateway.audit.log.record_from_row``).
RowReader = Callable[[sa.Row[Any]], EventRecord]


@dataclass
class Sweep:
    """One walk from the first event up to ``size`` (a signed checkpoint with ``root``)."""

    size: int
    root: bytes
    mac: EventMac | None
    started: float = field(default_factory=time.monotonic)
    frontier: CompactRange = field(default_factory=CompactRange)
    previous_hash: str = GENESIS_HASH
    macs: LegacyPrefix = field(init=False)

    def __post_init__(self) -> None:
        self.macs = LegacyPrefix(self.mac)

    @property
    def done(self) -> bool:
        return self.frontier.size >= self.size

    def advance(
        self, connection: sa.Connection, max_events: int, record: RowReader
    ) -> Problem | None:
        """Check the next ``max_events`` events at most; the first problem found, if any."""
        first, last = self.frontier.size + 1, min(self.frontier.size + max_events, self.size)
        query = (
            sa.select(audit_events)
            .where(audit_events.c.seq >= first, audit_events.c.seq <= last)
            .order_by(audit_events.c.seq)
        )
        for row in connection.execute(query):
            event = record(row)
            problem = event_problem(event, self.frontier.size + 1, self.previous_hash, self.macs)
            if problem is not None:
                return problem[0] if problem[0] is not None else event.seq, problem[1]
            self.frontier.append(leaf_hash(event.canonical_bytes()))
            self.previous_hash = event.event_hash
        if self.frontier.size < last:
            seq = self.frontier.size + 1
            return seq, f"event {seq} is missing"
        return self._finished() if self.done else None

    def _finished(self) -> Problem | None:
        unclosed = self.macs.finish(self.frontier.size)
        if unclosed is not None:
            return unclosed
        if self.frontier.root() != self.root:
            return None, (
                f"the stored events 1..{self.size} do not have the root of the checkpoint this "
                "gateway signed at that size"
            )
        return None


def slice_size(signed_size: int, tick_s: float, period_s: float) -> int:
    """Events to check per tick so that ``signed_size`` events take 90 % of ``period_s``
    (the rest is slack for slow reads and a growing log); at least one."""
    return max(1, math.ceil(signed_size * tick_s / (0.9 * period_s)))


def tick_seconds(period_s: float) -> float:
    """How often a slice runs: a hundredth of the period, within 1 s to 60 s."""
    return min(max(period_s / 100, 1.0), 60.0)
