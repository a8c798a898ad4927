"""Admission before any work: a request that would not fit the engine's queue is answered 429
at once, before its prompt is tokenized or its `request` event written.

The engine's own queue bound stays the last word (``QueueFullError``); this count, kept on the
event loop, only makes the common overload answer cheap: no database write, no thread hop.
A request takes one slot per choice (``n``), as the engine queues one job per choice.
"""

from __future__ import annotations

from gateway.errors import queue_full


class Admission:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.in_use = 0

    def admit(self, count: int) -> Slots:
        """Take ``count`` slots or raise the 429 APIError. Call on the event loop only."""
        if self.in_use + count > self.slots:
            raise queue_full()
        self.in_use += count
        return Slots(self, count)


class Slots:
    """Slots held by one request; ``release`` is idempotent."""

    def __init__(self, admission: Admission, count: int) -> None:
        self._admission = admission
        self._count = count

    def release(self) -> None:
        self._admission.in_use -= self._count
        self._count = 0
