"""Legacy events: those written at revision 0001, before events carried a MAC. Standard
library plus ``cryptography`` only (the offline verifier uses it).

Migration 0002 adopts such a log: it builds the Merkle tree over its events 1..N and records N
in the head row. The first event any gateway writes after that is a ``legacy_adopted``
*declaration* ``{"legacy_size": N}`` at seq N + 1, MAC'd like every other event, so every
checkpoint signed after the migration commits to the bound. The head row's copy is only what
tells the gateway to write the declaration; verification trusts the declaration alone:

- MAC-less events are accepted only as an unbroken run that the first MAC'd event closes, and
  that event must be the declaration of exactly the run's end (seq - 1);
- only the first declaration counts; a later one, a MAC-less one, or one of another size is
  reported, as is any MAC-less event after the declaration.

So a database attacker can neither widen the range (strip MACs after it, or move the bound)
nor shorten it without verification with the MAC key naming where.
"""

from __future__ import annotations

from typing import Any

from gateway.audit.mac import EventMac
from gateway.audit.records import EventRecord

LEGACY_KIND = "legacy_adopted"

Problem = tuple[int, str]


def declaration_payload(legacy_size: int) -> dict[str, Any]:
    return {"legacy_size": legacy_size}


def is_legacy_checkpoint(record: EventRecord) -> bool:
    """A revision-0001 checkpoint event: a signed JSON statement, not a C2SP note."""
    return record.kind == "checkpoint" and record.mac is None and "note" not in record.payload


class LegacyPrefix:
    """Checks each event's MAC in log order, allowing the MAC-less legacy prefix.

    A walk may start anywhere (an export of a range, a gateway resuming from its last signed
    checkpoint): MAC-less events are then *pending* until the declaration closes them, and
    ``finish`` reports a run that nothing closed. Without a MAC key only the declarations'
    positions and sizes are checked.
    """

    def __init__(self, mac: EventMac | None) -> None:
        self._mac = mac
        self.pending_from: int | None = None  # first seq of the open MAC-less run
        self.closed = False  # the declaration, or a MAC'd event with nothing pending, was seen

    @property
    def in_prefix(self) -> bool:
        """Whether the current event may still be a legacy one."""
        return not self.closed

    def event(self, record: EventRecord) -> Problem | None:
        """The problem with ``record``'s MAC or place, or None. Call it in seq order, after
        the sequence and chain checks."""
        mac = self._mac
        has_mac = record.mac is not None
        if mac is not None and has_mac and not mac.valid(record.canonical_bytes(), record.mac):
            if self.pending_from is not None and not self.closed:
                # Its MAC covers prev_hash: it seals the chain of the MAC-less run before it.
                return self.pending_from, (
                    f"event {record.seq} has a MAC that does not verify and is the first after "
                    f"the MAC-less events {self.pending_from}..{record.seq - 1}: those were "
                    f"rewritten (chain recomputed), or event {record.seq} was altered"
                )
            return record.seq, _forged(record, "has a MAC that does not verify")
        if record.kind == LEGACY_KIND:
            return self._declaration(record)
        if self.closed:
            if mac is not None and not has_mac:
                return record.seq, _forged(record, "has no MAC")
            return None
        if not has_mac:
            if self.pending_from is None:
                self.pending_from = record.seq
            return None
        if self.pending_from is not None:
            return self._unclosed(record.seq - 1)
        self.closed = True
        return None

    def _declaration(self, record: EventRecord) -> Problem | None:
        if self.closed:
            return record.seq, (
                f"event {record.seq} is a second legacy declaration: the legacy range is the "
                f"one the first declaration states (an attempt to move it)"
            )
        if self._mac is not None and record.mac is None:
            return record.seq, (
                f"event {record.seq} is a legacy declaration without a MAC: the legacy range "
                f"was widened or forged"
            )
        if record.payload != declaration_payload(record.seq - 1):
            return record.seq, (
                f"legacy declaration {record.seq} does not state the {record.seq - 1} events "
                f"before it"
            )
        self.closed, self.pending_from = True, None
        return None

    def finish(self, last_seq: int) -> Problem | None:
        """At the end of the walk: a MAC-less run still open is forged (with the MAC key)."""
        if self._mac is None or self.pending_from is None or self.closed:
            return None
        return self._unclosed(last_seq)

    def _unclosed(self, last: int) -> Problem:
        first = self.pending_from
        assert first is not None
        return first, (
            f"events {first}..{last} carry no MAC and no legacy declaration of their range "
            f"follows them: they were forged, or the legacy range was widened (MACs stripped)"
        )


def _forged(record: EventRecord, what: str) -> str:
    return (
        f"event {record.seq} {what}: it was not written by a gateway holding the MAC key "
        f"(forged, altered or moved)"
    )
