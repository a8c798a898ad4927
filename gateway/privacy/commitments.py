"""Keyed commitments to prompt and completion text, and content encryption under a data key.

A commitment is HMAC-SHA256 (hex) of the text's bytes under a key that only the deployment
holds: the data key of the request's subject where content is stored (destroying that key
ends every way to confirm a text against the record), else the deployment commitment key
derived from the KEK. A bare SHA-256 would let anyone who guesses a short text confirm it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Sequence
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gateway.privacy.kek import NONCE_BYTES, derive

DATA_KEY_BYTES = 32


class ContentUnreadableError(ValueError):
    """Content whose data key was destroyed, or ciphertext that does not open."""


def text_bytes(text: str) -> bytes:
    return text.encode("utf-8")


def token_id_bytes(token_ids: Sequence[int]) -> bytes:
    """A prompt given as token ids: the ids as decimal, comma-separated, in UTF-8."""
    return ",".join(str(token) for token in token_ids).encode("utf-8")


class CommitmentKey:
    """The key commitments are made under, and how a record names it (``describe``)."""

    def __init__(self, key: bytes, description: dict[str, Any]) -> None:
        self._key = key
        self.description = description

    def commit(self, data: bytes) -> str:
        return hmac.new(self._key, data, hashlib.sha256).hexdigest()

    def confirms(self, data: bytes, commitment: str) -> bool:
        return hmac.compare_digest(self.commit(data), commitment)


class DataKey:
    """One subject's data key (for one day): encrypts content and keys commitments."""

    def __init__(self, key_ref: str, key: bytes) -> None:
        if len(key) != DATA_KEY_BYTES:
            raise ValueError("a data key is 32 bytes")
        self.key_ref = key_ref
        self._encryption = derive(key, "specgate content encryption v1")
        self.commitments = CommitmentKey(
            derive(key, "specgate content commitment v1"), {"type": "data_key", "key_ref": key_ref}
        )

    @staticmethod
    def generate() -> bytes:
        return secrets.token_bytes(DATA_KEY_BYTES)

    def encrypt(self, content_id: str, value: Any) -> bytes:
        """AES-256-GCM of ``value`` as JSON, bound to ``content_id`` (nonce first)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        plaintext = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
        return nonce + AESGCM(self._encryption).encrypt(nonce, plaintext, content_id.encode())

    def decrypt(self, content_id: str, ciphertext: bytes) -> Any:
        ciphertext = bytes(ciphertext)
        try:
            plaintext = AESGCM(self._encryption).decrypt(
                ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:], content_id.encode()
            )
        except InvalidTag:
            raise ContentUnreadableError(f"content {content_id} does not open") from None
        return json.loads(plaintext)


def ciphertext_commitment(ciphertext: bytes) -> str:
    """What the chain holds of stored content: the SHA-256 of its ciphertext (hex)."""
    return hashlib.sha256(bytes(ciphertext)).hexdigest()
