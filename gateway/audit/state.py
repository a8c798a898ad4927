"""The last checkpoint this gateway signed, kept outside the database (a local file beside
the signing key, and in memory), with the chain head and the compact range at its size.

Whoever controls only the database cannot change it, so the gateway can check that the
database still extends what it signed before it signs again.
"""

from __future__ import annotations

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


def load_state(path: Path | None) -> SignedState:
    if path is None or not path.exists():
        return SignedState.empty()
    return SignedState.loads(path.read_text(encoding="utf-8"))


def save_state(path: Path | None, state: SignedState) -> None:
    if path is not None:
        write_atomically(path, state.dumps())


def write_atomically(path: Path, text: str) -> None:
    """Write (temporary file, fsync, rename) so that a crash leaves the old or the new text."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
