"""Per-event MACs: HMAC-SHA256 over an event's canonical bytes, with a secret the replicas share
through a file (a Kubernetes Secret) and that is never stored in the database.

A row inserted by someone who can write the database but lacks this key has no valid MAC, and
verification names it. The key id (a hash of the key) is recorded so a verifier can say "wrong
key" rather than "every event is forged".
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

MAC_KEY_BYTES = 32


class MacKeyError(ValueError):
    """The MAC key file is missing, unreadable or too short."""


class EventMac:
    def __init__(self, key: bytes) -> None:
        if len(key) < MAC_KEY_BYTES:
            raise MacKeyError(f"a MAC key has at least {MAC_KEY_BYTES} bytes")
        self._key = key

    @classmethod
    def from_file(cls, path: Path) -> EventMac:
        """The key in ``path``: hex text (as `openssl rand -hex 32` writes it) or raw bytes."""
        try:
            raw = Path(path).expanduser().read_bytes()
        except OSError as exc:
            raise MacKeyError(f"cannot read the MAC key {path}: {exc}") from exc
        try:
            return cls(bytes.fromhex(raw.decode("ascii").strip()))
        except (UnicodeDecodeError, ValueError):
            return cls(raw)

    @classmethod
    def load_or_create(cls, path: Path) -> EventMac:
        """Load the key at ``path``, or generate one there as hex (mode 0600)."""
        path = Path(path).expanduser()
        if path.exists():
            return cls.from_file(path)
        key = secrets.token_bytes(MAC_KEY_BYTES)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(key.hex() + "\n")
        return cls(key)

    @property
    def key_id(self) -> str:
        return "sha256:" + hashlib.sha256(b"specgate-audit-mac-key\n" + self._key).hexdigest()[:16]

    def derived(self, label: bytes) -> EventMac:
        """A sub-key for another kind of record, HMAC(key, label): a MAC made with it never
        verifies as an event MAC, nor the reverse, so records cannot be passed off as each
        other."""
        return EventMac(hmac.new(self._key, label, hashlib.sha256).digest())

    def mac(self, data: bytes) -> str:
        return hmac.new(self._key, data, hashlib.sha256).hexdigest()

    def valid(self, data: bytes, mac: str | None) -> bool:
        if not isinstance(mac, str):
            return False
        return hmac.compare_digest(self.mac(data).encode(), mac.encode("utf-8", "replace"))
