"""Quotas on the request path: each generating request of a key with limits (its own or its
team's) is checked and counted in the database before it is prepared, answered 429 in
OpenAI's shape when a limit is reached, and charged its tokens when served.

The check is one database call on the gateway's database pool, bounded like every other
(``audit_timeout_s``: a stalled store answers 503 ``audit_unavailable`` in that time). The
limits themselves (``gateway.quotas``) are remembered for ``key_cache_ttl_s``: a key known to
have none costs no database call, and a change made on another replica or with the CLI
applies within that time (at once through this gateway's admin API).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime

import structlog

from gateway.errors import APIError
from gateway.keys import Principal
from gateway.offload import Offload
from gateway.quota_limits import Limits
from gateway.quota_windows import Charge, QuotaWindows, Refusal, Verdict
from gateway.quotas import QuotaStore, QuotaUnverifiableError, key_subject, team_subject
from gateway.rate_limit_headers import headers_for, publish

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Ticket:
    """An admitted request's windows, to be charged its tokens when served."""

    charges: tuple[Charge, ...]


def subjects_of(principal: Principal) -> list[str]:
    subjects = [key_subject(principal.key_id)]
    if principal.team is not None:
        subjects.append(team_subject(principal.team))
    return subjects


class QuotaGate:
    def __init__(
        self, store: QuotaStore, windows: QuotaWindows, offload: Offload, ttl_s: float
    ) -> None:
        self._store = store
        self._windows = windows
        self._offload = offload
        self._ttl_s = ttl_s
        self._known: dict[str, tuple[Limits, float]] = {}
        self._lock = threading.Lock()

    @property
    def store(self) -> QuotaStore:
        return self._store

    async def admit(self, principal: Principal) -> Ticket | None:
        """Count the request against its limits and publish its rate-limit headers; None
        where none apply. Raises the 429 APIError when one is reached."""
        subjects = subjects_of(principal)
        known = self._remembered(subjects)
        if known is not None and not any(limits.any for limits in known.values()):
            return None
        verdict = await self._offload.db(self._admit, subjects, known)
        if verdict is None:
            return None
        headers = headers_for(verdict)
        publish(headers)
        if verdict.refusal is not None:
            raise refused(verdict.refusal, headers)
        return Ticket(verdict.charges)

    def charge(self, ticket: Ticket, tokens: int) -> Future[None]:
        """Start charging a served request's tokens (on the database pool)."""
        return self._offload.submit_db(
            self._windows.charge, ticket.charges, tokens, datetime.now(UTC)
        )

    async def settle(self, charging: Future[None]) -> None:
        """Wait for a charge within the database bound; a failed one is logged (the tokens
        then go uncounted: the store was down)."""
        try:
            await self._offload.wait_db(charging, "quota charge")
        except Exception as error:
            log.warning("quota_charge_failed", error=str(error))

    def forget(self, subject: str) -> None:
        """Read ``subject``'s limits afresh next time (after a change through this gateway)."""
        with self._lock:
            self._known.pop(subject, None)

    def _remembered(self, subjects: list[str]) -> dict[str, Limits] | None:
        now = time.monotonic()
        with self._lock:
            found = {s: self._known.get(s) for s in subjects}
        if any(entry is None or entry[1] < now for entry in found.values()):
            return None
        return {s: entry[0] for s, entry in found.items() if entry is not None}

    def _admit(self, subjects: list[str], known: dict[str, Limits] | None) -> Verdict | None:
        """On the database pool: read the limits where not remembered, then check."""
        if known is None:
            try:
                known = self._store.limits(subjects)
            except QuotaUnverifiableError as error:
                raise APIError(
                    503,
                    "This key's quota cannot be verified; an administrator has been alerted.",
                    type="service_unavailable",
                    code="quota_unverifiable",
                ) from error
            expires = time.monotonic() + self._ttl_s
            with self._lock:
                self._known.update({s: (limits, expires) for s, limits in known.items()})
        checks = [(subject, limits) for subject, limits in known.items() if limits.any]
        if not checks:
            return None
        return self._windows.admit(checks, datetime.now(UTC))


_PER = {"requests": "requests per minute", "tokens": "tokens per minute"}


def refused(refusal: Refusal, headers: dict[str, str]) -> APIError:
    """OpenAI's 429s: ``rate_limit_exceeded`` (type ``requests`` or ``tokens``) for a limit
    per minute, ``insufficient_quota`` for a spent token budget."""
    kind, _, name = refusal.subject.partition(":")
    who = f"{kind} {name}"
    retry = {**headers, "retry-after": str(refusal.reset_s)}
    if refusal.dimension == "budget":
        return APIError(
            429,
            f"The token budget of {who} ({refusal.limit} tokens) is spent; it renews in "
            f"{refusal.reset_s} s.",
            type="insufficient_quota",
            code="insufficient_quota",
            headers=retry,
        )
    return APIError(
        429,
        f"Rate limit reached for {who}: {refusal.limit} {_PER[refusal.dimension]}. "
        f"Retry in {refusal.reset_s} s.",
        type=refusal.dimension,
        code="rate_limit_exceeded",
        headers=retry,
    )
