"""vLLM replicas in pools: least-outstanding-requests routing and health state.

A replica is taken out when its active health check (``GET /health``) fails or a request
cannot reach it, and checked again every ``retry_interval_s`` until it answers; every change
is a ``ReplicaEvent`` (audited as a `backend_replica` event, counted in the metrics).
State is changed only on the backend's event loop; readers on other threads see whole values.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

Pool = Literal["speculative", "plain"]


@dataclass(frozen=True)
class ReplicaEvent:
    """A replica was taken out of routing (``removed``) or put back (``restored``)."""

    kind: ClassVar[str] = "backend_replica"

    url: str
    pool: Pool
    action: Literal["removed", "restored"]
    reason: str
    timestamp: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, object]:
        return {
            "url": self.url,
            "pool": self.pool,
            "action": self.action,
            "reason": self.reason,
            "timestamp": self.timestamp,
        }


@dataclass
class Replica:
    url: str
    pool: Pool
    speculative_config: dict[str, object] | None
    healthy: bool = True
    outstanding: int = 0
    last_error: str | None = None

    def take_out(self, reason: str) -> ReplicaEvent | None:
        """Mark it failed; the event only when it was in."""
        self.last_error = reason
        if not self.healthy:
            return None
        self.healthy = False
        return ReplicaEvent(self.url, self.pool, "removed", reason)

    def put_back(self) -> ReplicaEvent | None:
        if self.healthy:
            return None
        self.healthy = True
        return ReplicaEvent(self.url, self.pool, "restored", "health check answered")


class Replicas:
    """All replicas, grouped by pool."""

    def __init__(self, replicas: Iterable[Replica]) -> None:
        self.all = list(replicas)
        self._turn = itertools.count()

    def pool(self, pool: Pool) -> list[Replica]:
        return [replica for replica in self.all if replica.pool == pool]

    def has(self, pool: Pool) -> bool:
        return any(replica.pool == pool for replica in self.all)

    def pick(self, pool: Pool, exclude: Iterable[Replica] = ()) -> Replica | None:
        """The healthy replica of ``pool`` with the fewest requests in flight; ties go round
        the pool in turn, so an idle pool spreads its requests too."""
        skip = {id(replica) for replica in exclude}
        members = [r for r in self.pool(pool) if r.healthy and id(r) not in skip]
        if not members:
            return None
        fewest = min(replica.outstanding for replica in members)
        tied = [replica for replica in members if replica.outstanding == fewest]
        return tied[next(self._turn) % len(tied)]

    def any_healthy(self) -> Replica | None:
        """Any replica that is up, the least loaded first (for tokenizing)."""
        healthy = [replica for replica in self.all if replica.healthy]
        return min(healthy, key=lambda replica: replica.outstanding) if healthy else None

    @property
    def outstanding(self) -> int:
        return sum(replica.outstanding for replica in self.all)
