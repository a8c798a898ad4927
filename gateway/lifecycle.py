"""Graceful shutdown: SIGTERM sets a deadline ``shutdown_grace_s`` away, and everything the
shutdown does ends by it, database waits included.

Running generations may finish until the grace's last ``records_s`` (``audit_timeout_s``, or
half the grace if that is shorter); those still running then are ended: their backend work is
cancelled and their waits receive ``ShutdownError``, so that each answers with an error (a
stream: an error chunk) and records a `completion` event with outcome ``shutdown``. The rest
of the grace is kept for the final records (those completions, the `shutdown` event, the last
checkpoint): no database wait outlasts the deadline (``Offload.give_up_by``), and an event the
store does not take in time goes to the spool, committed by the next start.
"""

from __future__ import annotations

import asyncio
import time

from gateway.backends.base import Generation


class ShutdownError(Exception):
    """The grace period ended before this generation finished."""


def generations_s(grace_s: float, records_s: float) -> float:
    """How long after SIGTERM running generations may go on: the grace less the time kept for
    the final records (``records_s``, at most half the grace)."""
    return grace_s - min(records_s, grace_s / 2)


class Lifecycle:
    def __init__(self, grace_s: float, records_s: float) -> None:
        self.grace_s = grace_s
        self.generations_s = generations_s(grace_s, records_s)
        self.stopping = False
        self.deadline: float | None = None  # time.monotonic() by which the shutdown ends
        self._handles: set[Generation] = set()
        self._generations_timer: asyncio.TimerHandle | None = None

    def track(self, handles: list[Generation]) -> None:
        self._handles.update(handles)
        if self.stopping and self._generations_timer is None:
            self._end_running()

    def forget(self, handles: list[Generation]) -> None:
        self._handles.difference_update(handles)

    @property
    def running(self) -> int:
        return len(self._handles)

    def begin_shutdown(self) -> float:
        """Start the grace period (on the event loop); returns its deadline."""
        if self.deadline is not None:
            return self.deadline
        self.stopping = True
        self.deadline = time.monotonic() + self.grace_s
        loop = asyncio.get_running_loop()
        self._generations_timer = loop.call_later(self.generations_s, self._generations_over)
        return self.deadline

    def time_left(self, otherwise: float) -> float:
        """What is left of the grace (0 once it is over), or ``otherwise`` when no shutdown
        has begun."""
        if self.deadline is None:
            return otherwise
        return max(0.0, self.deadline - time.monotonic())

    def _generations_over(self) -> None:
        self._generations_timer = None
        self._end_running()

    def _end_running(self) -> None:
        error = ShutdownError(
            f"The gateway is shutting down; the generation was ended "
            f"{self.generations_s:g} s into its {self.grace_s:g} s grace period."
        )
        for handle in list(self._handles):
            handle.cancel()
            handle.put(error)
