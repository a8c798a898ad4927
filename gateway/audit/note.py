"""C2SP signed notes: ``tlog-checkpoint`` tree heads signed with Ed25519, and
``tlog-cosignature`` (v1) witness cosignatures over them. Standard library plus
``cryptography`` only, so the offline verifier and the witness can use it alone.

A checkpoint note reads::

    <origin>
    <tree size>
    <base64 root hash>

    — <key name> <base64(4-byte key hash || 64-byte Ed25519 signature over the body)>

The key hash is the first four bytes of SHA-256(name || 0x0A || 0x01 || public key); a
cosignature uses algorithm byte 0x04, carries an 8-byte big-endian Unix time before the
signature and signs ``"cosignature/v1\\ntime <t>\\n" || body``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gateway.audit.merkle import HASH_SIZE

SIGNATURE_DASH = "\u2014 "
ALG_ED25519 = 0x01
ALG_COSIGNATURE_V1 = 0x04
MAX_NOTE_BYTES = 1 << 16


class NoteError(ValueError):
    """A note that cannot be parsed, or whose signature is missing or wrong."""


@dataclass(frozen=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes
    text: str  # the whole signed note, as received

    @property
    def body(self) -> str:
        return checkpoint_body(self.origin, self.size, self.root)

    @property
    def root_b64(self) -> str:
        return base64.b64encode(self.root).decode("ascii")


def checkpoint_body(origin: str, size: int, root: bytes) -> str:
    return f"{origin}\n{size}\n{base64.b64encode(root).decode('ascii')}\n"


def _raw(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_hash(name: str, public_key: Ed25519PublicKey, algorithm: int = ALG_ED25519) -> bytes:
    return hashlib.sha256(
        name.encode("utf-8") + b"\n" + bytes([algorithm]) + _raw(public_key)
    ).digest()[:4]


def check_key_name(name: str) -> str:
    if not name or any(c.isspace() or c == "+" for c in name):
        raise ValueError(f"a note key name has no spaces and no '+': {name!r}")
    return name


def sign_checkpoint(origin: str, size: int, root: bytes, private_key: Ed25519PrivateKey) -> str:
    """A checkpoint note signed with the log's key; the key name is the origin."""
    body = checkpoint_body(check_key_name(origin), size, root)
    signature = private_key.sign(body.encode("utf-8"))
    value = key_hash(origin, private_key.public_key()) + signature
    return f"{body}\n{SIGNATURE_DASH}{origin} {base64.b64encode(value).decode('ascii')}\n"


def _split(text: str) -> tuple[str, list[tuple[str, bytes]]]:
    """(body, [(key name, decoded signature value)]) of a note."""
    if len(text.encode("utf-8")) > MAX_NOTE_BYTES:
        raise NoteError("note is too large")
    body, sep, signatures = text.partition("\n\n")
    if not sep or not signatures.endswith("\n"):
        raise NoteError("note has no signature block")
    body += "\n"
    parsed: list[tuple[str, bytes]] = []
    for line in signatures[:-1].split("\n"):
        if not line.startswith(SIGNATURE_DASH):
            raise NoteError("malformed signature line")
        name, _, encoded = line[len(SIGNATURE_DASH) :].partition(" ")
        try:
            value = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise NoteError("signature is not base64") from None
        if base64.b64encode(value).decode("ascii") != encoded or len(value) < 4:
            raise NoteError("signature is not canonical base64")
        parsed.append((name, value))
    return body, parsed


def parse_checkpoint(text: str) -> Checkpoint:
    """The checkpoint a note states (signatures are not checked here)."""
    body, _ = _split(text)
    lines = body[:-1].split("\n")
    if len(lines) < 3:
        raise NoteError("checkpoint body needs origin, size and root hash lines")
    origin, size_text, root_text = lines[:3]
    if not origin or not size_text.isdigit() or (size_text != "0" and size_text[0] == "0"):
        raise NoteError("checkpoint origin or tree size is malformed")
    try:
        root = base64.b64decode(root_text, validate=True)
    except (binascii.Error, ValueError):
        raise NoteError("checkpoint root hash is not base64") from None
    if len(root) != HASH_SIZE or base64.b64encode(root).decode("ascii") != root_text:
        raise NoteError("checkpoint root hash is not 32 bytes of canonical base64")
    if body != checkpoint_body(origin, int(size_text), root):
        raise NoteError("checkpoint has extension lines this log does not write")
    return Checkpoint(origin, int(size_text), root, text)


def verify_checkpoint(
    text: str, public_key: Ed25519PublicKey, origin: str | None = None
) -> Checkpoint:
    """The checkpoint, once a signature by ``public_key`` (named by the checkpoint's origin)
    verifies; raises NoteError otherwise."""
    checkpoint = parse_checkpoint(text)
    if origin is not None and checkpoint.origin != origin:
        raise NoteError(f"checkpoint is for log {checkpoint.origin!r}, not {origin!r}")
    verify_note(text, checkpoint.origin, public_key)
    return checkpoint


def verify_note(text: str, name: str, public_key: Ed25519PublicKey) -> str:
    """The body of a signed note once its Ed25519 signature by key ``name`` verifies;
    signatures by other keys are ignored, as C2SP signed-note requires."""
    body, signatures = _split(text)
    expected = key_hash(name, public_key)
    for signer, value in signatures:
        if signer != name or value[:4] != expected:
            continue
        try:
            public_key.verify(value[4:], body.encode("utf-8"))
        except InvalidSignature:
            raise NoteError("note signature does not verify with the given key") from None
        return body
    raise NoteError("note carries no signature by the given key")


def _cosigned_message(body: str, timestamp: int) -> bytes:
    return f"cosignature/v1\ntime {timestamp}\n{body}".encode()


def add_cosignature(
    text: str, witness_name: str, private_key: Ed25519PrivateKey, timestamp: int
) -> str:
    """``text`` with a tlog-cosignature/v1 line by the witness appended."""
    body, _ = _split(text)
    signature = private_key.sign(_cosigned_message(body, timestamp))
    value = (
        key_hash(check_key_name(witness_name), private_key.public_key(), ALG_COSIGNATURE_V1)
        + struct.pack(">Q", timestamp)
        + signature
    )
    return f"{text}{SIGNATURE_DASH}{witness_name} {base64.b64encode(value).decode('ascii')}\n"


def cosignature_time(text: str, witness_name: str, public_key: Ed25519PublicKey) -> int:
    """The Unix time of the witness's valid cosignature on the note; raises NoteError."""
    body, signatures = _split(text)
    expected = key_hash(witness_name, public_key, ALG_COSIGNATURE_V1)
    for name, value in signatures:
        if name != witness_name or value[:4] != expected or len(value) != 4 + 8 + 64:
            continue
        (timestamp,) = struct.unpack(">Q", value[4:12])
        try:
            public_key.verify(value[12:], _cosigned_message(body, timestamp))
        except InvalidSignature:
            raise NoteError("cosignature does not verify with the witness key") from None
        return int(timestamp)
    raise NoteError(f"note carries no cosignature by witness {witness_name!r}")
