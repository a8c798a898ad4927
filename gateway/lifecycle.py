"""Graceful shutdown: on SIGTERM, running generations may finish for ``shutdown_grace_s``;
those still running then are ended: their backend work is cancelled and their waits receive
``ShutdownError``, so that each answers with an error (a stream: an error chunk) and records a
`completion` event with outcome ``shutdown``."""

from __future__ import annotations

import asyncio

from gateway.backends.base import Generation


class ShutdownError(Exception):
    """The grace period ended before this generation finished."""


class Lifecycle:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.stopping = False
        self._handles: set[Generation] = set()
        self._grace_timer: asyncio.TimerHandle | None = None

    def track(self, handles: list[Generation]) -> None:
        self._handles.update(handles)
        if self.stopping and self._grace_timer is None:
            self._end_running()

    def forget(self, handles: list[Generation]) -> None:
        self._handles.difference_update(handles)

    @property
    def running(self) -> int:
        return len(self._handles)

    def begin_shutdown(self) -> None:
        """Start the grace period (on the event loop)."""
        if self.stopping:
            return
        self.stopping = True
        loop = asyncio.get_running_loop()
        self._grace_timer = loop.call_later(self.grace_s, self._grace_over)

    def _grace_over(self) -> None:
        self._grace_timer = None
        self._end_running()

    def _end_running(self) -> None:
        error = ShutdownError(
            f"The gateway is shutting down; the generation was ended after the "
            f"{self.grace_s:g} s grace period."
        )
        for handle in list(self._handles):
            handle.cancel()
            handle.put(error)
