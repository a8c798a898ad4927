"""Recently authenticated keys, remembered for a few seconds so that a request's key check
needs no database round trip or thread hop (the refusal path above all: a 429 at admission
then costs only the event loop's own work).

Only keys the database accepted are remembered: ``KeyStore.authenticate`` returns a principal
only for a row that passed its MAC and audit-chain check (``gateway.key_rows``), so an entry
holds a verified row's role and choices; a row changed after that is checked, and refused,
at the first lookup after the entry expires. Entries are kept by the key's SHA-256 (never the
plaintext), each for ``ttl_s`` from the lookup that found it; an unknown or refused key is
asked about every time. A key
revoked anywhere (another replica, ``specgate keys revoke``) stops working here within
``ttl_s``; one revoked through this gateway's admin API stops at once (``forget``). A key
that expired from the cache is looked up again, so a database that is away still answers
503 once the entry is older than ``ttl_s``: the cache never outlives the store by more.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.keys import Principal, hash_key


@dataclass(frozen=True)
class Lookup:
    """Taken before a database lookup: when it started, and how many revocations this cache
    had seen then (a lookup that raced a revocation here is not remembered)."""

    started_at: float
    revocations: int


class KeyCache:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, tuple[Principal, float]] = {}
        self._revocations = 0

    def get(self, plaintext: str) -> Principal | None:
        """The principal a lookup found less than ``ttl_s`` ago, or None (look it up)."""
        if self.ttl_s <= 0:
            return None
        digest = hash_key(plaintext)
        entry = self._entries.get(digest)
        if entry is None:
            return None
        principal, found_at = entry
        if self._clock() - found_at >= self.ttl_s:
            del self._entries[digest]
            return None
        return principal

    def lookup(self) -> Lookup:
        """Call before asking the database; pass the result to ``remember``."""
        return Lookup(self._clock(), self._revocations)

    def remember(self, plaintext: str, principal: Principal, lookup: Lookup) -> None:
        """Keep what a lookup found, dated from when it started (never fresher than what
        the database said), unless a key was revoked here meanwhile."""
        if self.ttl_s > 0 and lookup.revocations == self._revocations:
            self._entries[hash_key(plaintext)] = (principal, lookup.started_at)

    def forget(self, key_id_or_name: str) -> None:
        """Drop the entries of a key revoked or changed here (by id or by name)."""
        self._revocations += 1
        for digest, (principal, _) in list(self._entries.items()):
            if key_id_or_name in (principal.key_id, principal.name):
                del self._entries[digest]
