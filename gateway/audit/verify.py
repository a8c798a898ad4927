"""Offline verification of an audit export: needs only the export, the gateway's public key
and, for the per-event MACs, the MAC key; never the server or its database
(``specgate audit verify``). Standard library plus ``cryptography`` only.

What it checks: every line's canonical form; a gapless sequence; every event's chain hash
and prev_hash link; every event's MAC (with the key; MAC-less legacy events from before
revision 0002 only where ``legacy`` allows them); every ``checkpoint`` event inside the
export against the tree recomputed at its size; the closing signed checkpoint against the
tree of the exported events plus the subtrees the export carries; and, given a checkpoint the
auditor already trusts, that the exported tree extends it (same root at its size, or an RFC
9162 consistency proof). It stops at, and names, the first bad event.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from gateway.audit.legacy import LegacyPrefix, is_legacy_checkpoint
from gateway.audit.mac import EventMac
from gateway.audit.merkle import (
    CompactRange,
    ProofError,
    aligned_pieces,
    leaf_hash,
    verify_consistency,
)
from gateway.audit.note import Checkpoint, NoteError, parse_checkpoint, verify_checkpoint
from gateway.audit.records import (
    CheckpointRecord,
    ErasedRecord,
    EventRecord,
    RecordFormatError,
    TreeRecord,
    decode_line,
    detect_format,
)
from gateway.audit.signing import PublicKeyError, key_fingerprint, load_public_key


@dataclass
class VerifyReport:
    ok: bool
    events_checked: int
    first_bad_seq: int | None
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Failed(Exception):
    def __init__(self, seq: int | None, reason: str) -> None:
        super().__init__(reason)
        self.seq, self.reason = seq, reason


def event_problem(
    record: EventRecord,
    expected_seq: int,
    previous_hash: str | None,
    macs: LegacyPrefix | None,
) -> tuple[int | None, str] | None:
    """(first bad seq, why) for an event that does not continue the log, else None.
    ``previous_hash`` None: the previous event is not known (the first exported one).
    ``macs`` checks the MAC in its place (the legacy prefix, see ``legacy``); None: not."""
    if record.seq != expected_seq:
        return expected_seq, (
            f"sequence broken: expected event {expected_seq}, found event {record.seq} "
            f"(events missing, repeated or reordered)"
        )
    if record.computed_hash() != record.event_hash:
        return record.seq, f"event {record.seq} was altered: its event_hash does not recompute"
    if previous_hash is not None and record.prev_hash != previous_hash:
        return record.seq, (
            f"event {record.seq}: prev_hash does not match the hash of event {record.seq - 1}"
        )
    return macs.event(record) if macs is not None else None


def trusted_checkpoint_text(text: str) -> str:
    """The checkpoint note in ``text``: a note as ``GET /v1/audit/checkpoint`` returns it, or
    an earlier export, whose closing checkpoint is taken."""
    try:
        parse_checkpoint(text)
        return text
    except NoteError:
        pass
    lines = text.splitlines(keepends=True)
    if not lines:
        raise NoteError("the trusted checkpoint file is empty")
    fmt = detect_format(lines[0])
    try:
        record = decode_line(lines[-1], fmt)
    except RecordFormatError as exc:
        raise NoteError(
            f"the trusted checkpoint file is neither a note nor an export: {exc}"
        ) from None
    if not isinstance(record, CheckpointRecord):
        raise NoteError("the trusted checkpoint file's last line is not a checkpoint")
    return record.note


@dataclass
class _Walk:
    """The verifier's running state over the exported events."""

    key: Ed25519PublicKey
    mac: EventMac | None
    trusted: Checkpoint | None
    tree: TreeRecord
    frontier: CompactRange
    checked_upto: int  # the largest tree size whose root a signature vouched for
    legacy: LegacyPrefix
    count: int = 0
    previous_hash: str | None = None
    trusted_checked: bool = False

    def check_trusted_here(self) -> None:
        trusted = self.trusted
        if trusted is None or self.frontier.size != trusted.size or self.trusted_checked:
            return
        self.trusted_checked = True
        if self.frontier.root() != trusted.root:
            raise _Failed(*self._span(trusted.size, "the trusted checkpoint"))
        self.checked_upto = max(self.checked_upto, trusted.size)

    def _span(self, size: int, what: str) -> tuple[int | None, str]:
        first = self.checked_upto + 1
        return first, (
            f"the events up to {size} do not give the root hash of {what} (size {size}): "
            f"history was rewritten or forked somewhere in events {first}..{size}"
            + ("" if self.mac else "; pass --mac-key to name the event")
        )

    def event(self, record: EventRecord) -> None:
        problem = event_problem(record, self.frontier.size + 1, self.previous_hash, self.legacy)
        if problem is not None:
            raise _Failed(*problem)
        self.check_trusted_here()
        if record.kind == "checkpoint" and not (
            self.legacy.in_prefix and is_legacy_checkpoint(record)
        ):
            self._inner_checkpoint(record)
        self.frontier.append(leaf_hash(record.canonical_bytes()))
        self.previous_hash = record.event_hash
        self.count += 1

    def _inner_checkpoint(self, record: EventRecord) -> None:
        note = record.payload.get("note")
        if not isinstance(note, str):
            raise _Failed(record.seq, f"checkpoint event {record.seq} holds no note")
        try:
            checkpoint = verify_checkpoint(note, self.key)
        except NoteError as exc:
            raise _Failed(record.seq, f"checkpoint event {record.seq}: {exc}") from None
        if checkpoint.size != record.seq - 1:
            raise _Failed(
                record.seq,
                f"checkpoint event {record.seq} states tree size {checkpoint.size}, "
                f"not {record.seq - 1}",
            )
        if checkpoint.root != self.frontier.root():
            raise _Failed(*self._span(checkpoint.size, f"checkpoint event {record.seq}"))
        self.checked_upto = checkpoint.size

    def close(self, closing: Checkpoint) -> None:
        end, size = self.frontier.size, closing.size
        unclosed = self.legacy.finish(end)
        if unclosed is not None:
            raise _Failed(*unclosed)
        if size < end:
            raise _Failed(size + 1, f"the checkpoint covers {size} events, fewer than exported")
        pieces = aligned_pieces(end, size)
        if len(pieces) != len(self.tree.right):
            raise _Failed(end + 1, "the tree record does not cover the rest of the tree")
        for (level, _), digest in zip(pieces, self.tree.right, strict=True):
            self.frontier.append_subtree(level, digest)
        if self.frontier.root() != closing.root:
            raise _Failed(*self._span(size, "the closing checkpoint"))
        self.checked_upto = size
        self._close_trusted(closing)

    def _close_trusted(self, closing: Checkpoint) -> None:
        trusted = self.trusted
        if trusted is None or self.trusted_checked:
            return
        if trusted.size > closing.size:
            # With the MAC key every exported event is known to be a gateway's, so the first
            # one missing is the first after them; without it, any of them may be replaced.
            end = self.tree.start + self.count
            first = end + 1 if self.mac is not None else None
            raise _Failed(
                first,
                f"the trusted checkpoint has {trusted.size} events, the export's tree only "
                f"{closing.size}: the log was truncated (or this is a stale fork); "
                + (
                    f"events from {end + 1} are missing"
                    if first
                    else f"the first changed event is one of 1..{closing.size + 1}"
                ),
            )
        if self.tree.consistency_from != trusted.size:
            raise _Failed(
                None,
                f"the export carries no consistency proof from the trusted size {trusted.size} "
                f"(export it with consistency_from={trusted.size})",
            )
        try:
            verify_consistency(
                trusted.size, closing.size, self.tree.consistency, trusted.root, closing.root
            )
        except ProofError as exc:
            raise _Failed(
                None, f"the export's tree does not extend the trusted checkpoint: {exc}"
            ) from None


def verify_export(
    lines: Iterable[str],
    public_key_pem: bytes,
    *,
    mac: EventMac | None = None,
    trusted_checkpoint: str | None = None,
) -> VerifyReport:
    """Check an export line by line (see the module docstring). ``mac``: check every event's
    MAC; ``trusted_checkpoint``: a checkpoint note the auditor already holds."""
    try:
        key = load_public_key(public_key_pem)
    except PublicKeyError as exc:
        return VerifyReport(False, 0, None, str(exc))
    trusted = None
    if trusted_checkpoint is not None:
        try:
            trusted = verify_checkpoint(trusted_checkpoint, key)
        except NoteError as exc:
            return VerifyReport(False, 0, None, f"the trusted checkpoint is not valid: {exc}")
    iterator = iter(lines)
    first_line = next(iterator, None)
    if first_line is None:
        return VerifyReport(False, 0, None, "the export is empty")
    fmt = detect_format(first_line)
    if fmt == "csv":
        numbered = enumerate(iterator, start=2)
    else:
        numbered = enumerate(itertools.chain([first_line], iterator), start=1)
    walk: _Walk | None = None
    closing: Checkpoint | None = None
    exported_ids: set[str] = set()
    erased: ErasedRecord | None = None
    try:
        for line_number, line in numbered:
            next_seq = walk.frontier.size + 1 if walk else None
            if closing is not None:
                raise _Failed(next_seq, f"line {line_number}: data after the checkpoint")
            try:
                record = decode_line(line, fmt)
            except RecordFormatError as exc:
                raise _Failed(next_seq, f"line {line_number}: {exc}") from None
            if walk is None:
                if not isinstance(record, TreeRecord):
                    raise _Failed(
                        None, f"line {line_number}: the export does not start with its tree record"
                    )
                try:
                    frontier = CompactRange(record.start, list(record.left))
                except ValueError as exc:
                    raise _Failed(record.start + 1, f"tree record: {exc}") from None
                walk = _Walk(
                    key, mac, trusted, record, frontier, checked_upto=0, legacy=LegacyPrefix(mac)
                )
            elif isinstance(record, EventRecord):
                if erased is not None:
                    raise _Failed(next_seq, f"line {line_number}: an event after the erased record")
                walk.event(record)
                exported_ids.add(record.event_id)
            elif isinstance(record, ErasedRecord):
                unknown = set(record.event_ids) - exported_ids
                if erased is not None or unknown:
                    raise _Failed(
                        None,
                        f"line {line_number}: "
                        + ("a second erased record" if erased else "erased events not exported"),
                    )
                erased = record
            elif isinstance(record, CheckpointRecord):
                try:
                    closing = verify_checkpoint(record.note, key)
                except NoteError as exc:
                    raise _Failed(
                        walk.frontier.size,
                        f"closing checkpoint: {exc} ({key_fingerprint(key)})",
                    ) from None
                if trusted is not None and closing.origin != trusted.origin:
                    raise _Failed(
                        None,
                        "the export and the trusted checkpoint are of "
                        f"different logs ({closing.origin!r}, {trusted.origin!r})",
                    )
                first_seq, last_seq = walk.tree.start + 1, walk.frontier.size
                walk.check_trusted_here()
                walk.close(closing)
            else:
                raise _Failed(next_seq, f"line {line_number}: a second tree record")
        if walk is None or closing is None:
            bad = walk.frontier.size + 1 if walk else None
            raise _Failed(bad, "no checkpoint at the end: the export is truncated")
    except _Failed as failure:
        return VerifyReport(False, walk.count if walk else 0, failure.seq, failure.reason)
    macs = "MACs checked" if mac else "MACs not checked (no MAC key given)"
    if erased is not None:
        macs += f"; content of {len(erased.event_ids)} events erased"
    against = f", consistent with the trusted checkpoint of size {trusted.size}" if trusted else ""
    if walk.count == 0:
        return VerifyReport(
            True, 0, None, f"ok: no events in range; tree of {closing.size} signed{against}"
        )
    return VerifyReport(
        True,
        walk.count,
        None,
        f"ok: events {first_seq}..{last_seq} intact, {macs}, in the signed tree of "
        f"{closing.size} events ({closing.origin}, {key_fingerprint(key)}){against}",
    )
