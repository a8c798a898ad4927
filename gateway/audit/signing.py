"""The gateway's Ed25519 key, which signs checkpoints as C2SP ``tlog-checkpoint`` notes
(``note.sign_checkpoint``), and loading the public key an auditor pins."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gateway.audit.note import check_key_name, sign_checkpoint

DEFAULT_ORIGIN = "specgate.local/audit"


class PublicKeyError(ValueError):
    """The given public key is not an Ed25519 public key in PEM."""


def key_fingerprint(public_key: Ed25519PublicKey) -> str:
    """SHA-256 over the raw public key, hex: lets an auditor see which key signed."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def load_public_key(pem: bytes) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(pem)
    except ValueError as exc:
        raise PublicKeyError(f"not a PEM public key: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise PublicKeyError("the public key is not an Ed25519 key")
    return key


def load_or_create_private_key(path: Path) -> Ed25519PrivateKey:
    """Load the PEM (PKCS#8) Ed25519 key at ``path``, or generate one there (mode 0600)."""
    path = Path(path).expanduser()
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path} does not hold an Ed25519 private key")
        return key
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(pem)
    return key


def public_key_pem(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


class CheckpointSigner:
    """Holds the gateway's Ed25519 signing key and the log's origin (its name in notes)."""

    def __init__(self, private_key: Ed25519PrivateKey, origin: str = DEFAULT_ORIGIN) -> None:
        self._private_key = private_key
        self.origin = check_key_name(origin)

    @classmethod
    def load_or_create(cls, path: Path, origin: str = DEFAULT_ORIGIN) -> CheckpointSigner:
        return cls(load_or_create_private_key(path), origin)

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._private_key.public_key()

    @property
    def fingerprint(self) -> str:
        return key_fingerprint(self.public_key)

    def public_key_pem(self) -> bytes:
        return public_key_pem(self.public_key)

    def sign_checkpoint(self, size: int, root: bytes) -> str:
        """A signed ``tlog-checkpoint`` note for the tree of ``size`` leaves with ``root``."""
        return sign_checkpoint(self.origin, size, root, self._private_key)
