"""What this gateway knows of the log without the database, kept in local files beside the
signing key (and in memory): the last checkpoint it signed, with the chain head and the
compact range at its size; the tree after its newest committed append (``Anchor``, written
before the append's caller is answered); and a raised tamper alarm (``Alarm``), which stands
until an operator clears it.

Whoever controls only the database cannot change them, so the gateway can check that the
database still extends what it signed and wrote before it appends or signs again.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gateway.audit.canonical import GENESIS_HASH
from gateway.audit.merkle import CompactRange
from gateway.audit.records import b64, unb64_hash


@dataclass(frozen=True)
class SignedState:
    note: str  # the signed checkpoint note ("" before the first one)
    head_hash: str  # event_hash of the last event in the tree
    frontier: CompactRange

    @classmethod
    def empty(cls) -> SignedState:
        return cls("", GENESIS_HASH, CompactRange())

    def dumps(self) -> str:
        return json.dumps(
            {
                "note": self.note,
                "head_hash": self.head_hash,
                "size": self.frontier.size,
                "frontier": [b64(h) for h in self.frontier.hashes],
            },
            indent=1,
        )

    @classmethod
    def loads(cls, text: str) -> SignedState:
        value = json.loads(text)
        frontier = CompactRange(int(value["size"]), [unb64_hash(h) for h in value["frontier"]])
        return cls(str(value["note"]), str(value["head_hash"]), frontier)


@dataclass(frozen=True)
class Anchor:
    """The tree after this gateway's newest committed append, or the newest head it verified:
    ``size`` leaves, the chain's ``head_hash`` and the compact range (``hashes``)."""

    size: int
    head_hash: str
    hashes: tuple[bytes, ...]

    @classmethod
    def after(cls, frontier: CompactRange, head_hash: str) -> Anchor:
        return cls(frontier.size, head_hash, tuple(frontier.hashes))

    def frontier(self) -> CompactRange:
        return CompactRange(self.size, list(self.hashes))

    @functools.cached_property
    def root(self) -> bytes:
        return self.frontier().root()

    def as_state(self) -> SignedState:
        """The anchor as a starting point for checking the events after it."""
        return SignedState("", self.head_hash, self.frontier())

    def dumps(self) -> str:
        return json.dumps(
            {
                "size": self.size,
                "head_hash": self.head_hash,
                "frontier": [b64(h) for h in self.hashes],
            }
        )

    @classmethod
    def loads(cls, text: str) -> Anchor:
        value = json.loads(text)
        hashes = tuple(unb64_hash(h) for h in value["frontier"])
        return cls(int(value["size"]), str(value["head_hash"]), hashes)


NO_ANCHOR = Anchor(0, GENESIS_HASH, ())


@dataclass(frozen=True)
class Alarm:
    """A tamper alarm as kept on disk: the first bad event (if known), why, and when."""

    first_bad_seq: int | None
    reason: str
    detected_at: str

    def dumps(self) -> str:
        return json.dumps(
            {
                "first_bad_seq": self.first_bad_seq,
                "reason": self.reason,
                "detected_at": self.detected_at,
            }
        )

    @classmethod
    def loads(cls, text: str) -> Alarm:
        value = json.loads(text)
        seq = value["first_bad_seq"]
        return cls(
            None if seq is None else int(seq), str(value["reason"]), str(value["detected_at"])
        )


def beside(state_path: Path | None, suffix: str) -> Path | None:
    """The file ``suffix`` next to the signed-state file (``audit-checkpoint-state.json`` gives
    ``audit-checkpoint-state.appended`` and ``audit-checkpoint-state.alarm``)."""
    return None if state_path is None else state_path.with_suffix(suffix)


def load_anchor(path: Path | None) -> Anchor:
    if path is None or not path.exists():
        return NO_ANCHOR
    return Anchor.loads(path.read_text(encoding="utf-8"))


def save_anchor(path: Path | None, anchor: Anchor) -> None:
    """Written without an fsync (it costs a disk flush per append): it survives the process
    being killed or restarted, not the host losing its page cache; then the last signed
    checkpoint is the bound (``checkpoint_interval_s``)."""
    if path is not None:
        write_atomically(path, anchor.dumps(), sync=False)


def load_alarm(path: Path | None) -> Alarm | None:
    if path is None or not path.exists():
        return None
    return Alarm.loads(path.read_text(encoding="utf-8"))


def save_alarm(path: Path | None, alarm: Alarm | None) -> None:
    """Keep ``alarm`` (synced: it must outlive a crash); None removes it."""
    if path is None:
        return
    if alarm is None:
        path.unlink(missing_ok=True)
    else:
        write_atomically(path, alarm.dumps())


def load_state(path: Path | None) -> SignedState:
    if path is None or not path.exists():
        return SignedState.empty()
    return SignedState.loads(path.read_text(encoding="utf-8"))


def save_state(path: Path | None, state: SignedState) -> None:
    if path is not None:
        write_atomically(path, state.dumps())


def write_atomically(path: Path, text: str, sync: bool = True) -> None:
    """Write (temporary file, fsync unless not ``sync``, rename) so that a crash leaves the
    old or the new text."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            if sync:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
