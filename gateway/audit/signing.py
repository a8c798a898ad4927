"""Ed25519 signatures over checkpoints: statements of the form "the chain up to event ``seq``
has head hash ``head_hash``", signed at ``signed_at``.

A signed checkpoint is the statement (a JSON object) plus ``signature``: the base64 Ed25519
signature over the canonical JSON of the statement without the signature.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gateway.audit.canonical import canonical_json

CHECKPOINT_FORMAT = "specgate-audit-checkpoint/1"


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


def _signed_bytes(checkpoint: dict[str, Any]) -> bytes:
    statement = {name: value for name, value in checkpoint.items() if name != "signature"}
    return canonical_json(statement).encode("utf-8")


def checkpoint_signature_valid(checkpoint: dict[str, Any], public_key: Ed25519PublicKey) -> bool:
    encoded = checkpoint.get("signature")
    if not isinstance(encoded, str):
        return False
    try:
        signature = base64.b64decode(encoded, validate=True)
    except ValueError:  # binascii.Error, or characters outside ASCII
        return False
    # Base64 has spare bits; insist on the one canonical spelling of the signature.
    if base64.b64encode(signature).decode("ascii") != encoded:
        return False
    try:
        public_key.verify(signature, _signed_bytes(checkpoint))
    except InvalidSignature:
        return False
    return True


class CheckpointSigner:
    """Holds the gateway's Ed25519 signing key."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key

    @classmethod
    def load_or_create(cls, path: Path) -> CheckpointSigner:
        """Load the PEM (PKCS#8) key at ``path``, or generate one there (mode 0600)."""
        path = Path(path).expanduser()
        if path.exists():
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(key, Ed25519PrivateKey):
                raise ValueError(f"{path} does not hold an Ed25519 private key")
            return cls(key)
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
        return cls(key)

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._private_key.public_key()

    @property
    def fingerprint(self) -> str:
        return key_fingerprint(self.public_key)

    def public_key_pem(self) -> bytes:
        return self.public_key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def sign(self, statement: dict[str, Any]) -> dict[str, Any]:
        """The statement with ``format``, ``key_fingerprint`` and its ``signature`` added."""
        body = {**statement, "format": CHECKPOINT_FORMAT, "key_fingerprint": self.fingerprint}
        signature = self._private_key.sign(_signed_bytes(body))
        return {**body, "signature": base64.b64encode(signature).decode("ascii")}
