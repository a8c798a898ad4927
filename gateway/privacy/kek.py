"""The key-encryption key (KEK): wraps every data key, and derives the deployment's keyed
references. It lives in a file (a Kubernetes Secret), never in the database.

From the KEK two further keys are derived with HKDF-SHA256, each under its own label: the key
of subject references (``subject_ref``: who a record is about, without naming them) and the
deployment commitment key (prompt and completion commitments where no content is stored).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEK_BYTES = 32
NONCE_BYTES = 12


class KekError(ValueError):
    """The KEK file is missing, unreadable or malformed, or a wrapped key does not open."""


def derive(key: bytes, label: str) -> bytes:
    """A 32-byte key for one purpose from ``key`` (HKDF-SHA256, no salt, ``label`` as info)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=label.encode()).derive(key)


class KeyEncryptionKey:
    def __init__(self, key: bytes) -> None:
        if len(key) != KEK_BYTES:
            raise KekError(f"a KEK is exactly {KEK_BYTES} bytes (64 hex digits)")
        self._key = key
        self._subject_key = derive(key, "specgate subject reference v1")
        self.commitment_key = derive(key, "specgate deployment commitment v1")

    @classmethod
    def from_file(cls, path: Path) -> KeyEncryptionKey:
        try:
            text = Path(path).expanduser().read_text("ascii").strip()
            return cls(bytes.fromhex(text))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise KekError(f"cannot read the KEK {path}: {exc}") from exc

    @classmethod
    def create(cls, path: Path) -> KeyEncryptionKey:
        """Write a fresh KEK to ``path`` as hex (mode 0600); refuses to overwrite one."""
        path = Path(path).expanduser()
        key = secrets.token_bytes(KEK_BYTES)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise KekError(f"{path} exists already; a KEK is never overwritten") from None
        with os.fdopen(descriptor, "w") as handle:
            handle.write(key.hex() + "\n")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: Path) -> KeyEncryptionKey:
        path = Path(path).expanduser()
        return cls.from_file(path) if path.exists() else cls.create(path)

    @property
    def key_id(self) -> str:
        return "sha256:" + hashlib.sha256(b"specgate-kek\n" + self._key).hexdigest()[:16]

    def subject_ref(self, subject: str) -> str:
        """The keyed reference of a data subject: HMAC-SHA256 of its id, 32 hex digits.
        Only a holder of the KEK can tell which subject a reference is."""
        digest = hmac.new(self._subject_key, subject.encode("utf-8"), hashlib.sha256)
        return digest.hexdigest()[:32]

    def wrap(self, data_key: bytes, key_ref: str) -> bytes:
        """AES-256-GCM of ``data_key`` bound to its ``key_ref`` (nonce first)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        return nonce + AESGCM(self._key).encrypt(nonce, data_key, key_ref.encode())

    def unwrap(self, wrapped: bytes, key_ref: str) -> bytes:
        wrapped = bytes(wrapped)
        try:
            return AESGCM(self._key).decrypt(
                wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:], key_ref.encode()
            )
        except InvalidTag:
            raise KekError(f"data key {key_ref} does not open with this KEK") from None
