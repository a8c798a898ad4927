"""C2SP signed notes, checkpoints and cosignatures: interoperable with Go's
golang.org/x/mod/sumdb/note (its published test key and signed note verify here), and every
change to a signed checkpoint is rejected."""

from __future__ import annotations

import base64
import re

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gateway.audit.note import (
    NoteError,
    add_cosignature,
    cosignature_time,
    key_hash,
    sign_checkpoint,
    verify_checkpoint,
    verify_note,
)

# The verifier key and signed note of golang.org/x/mod/sumdb/note's tests.
GO_VERIFIER_KEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
GO_SIGNED_NOTE = (
    "If you think cryptography is the answer to your problem,\n"
    "then you don't know what your problem is.\n"
    "\n"
    "\u2014 PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXg"
    "KvqfqdngotpRZb6KE6RyyBwJnAM=\n"
)


def test_go_sumdb_note_vector_verifies() -> None:
    name, hash_hex, encoded = GO_VERIFIER_KEY.split("+")
    raw = base64.b64decode(encoded)
    assert raw[0] == 0x01  # Ed25519
    key = Ed25519PublicKey.from_public_bytes(raw[1:])
    assert key_hash(name, key).hex() == hash_hex
    body = verify_note(GO_SIGNED_NOTE, name, key)
    assert body.startswith("If you think cryptography")
    with pytest.raises(NoteError):
        verify_note(GO_SIGNED_NOTE.replace("problem,", "problem;"), name, key)


def test_every_change_to_a_checkpoint_is_rejected() -> None:
    key = Ed25519PrivateKey.generate()
    note = sign_checkpoint("example.com/log", 42, bytes(range(32)), key)
    assert verify_checkpoint(note, key.public_key(), "example.com/log").size == 42
    raw = note.encode()
    for position in range(len(raw)):
        flipped = bytearray(raw)
        flipped[position] ^= 0x01
        with pytest.raises((NoteError, UnicodeDecodeError)):
            verify_checkpoint(bytes(flipped).decode(), key.public_key())
    other = Ed25519PrivateKey.generate().public_key()
    with pytest.raises(NoteError, match="no signature by the given key"):
        verify_checkpoint(note, other)
    with pytest.raises(NoteError, match=re.escape("not 'other.org/log'")):
        verify_checkpoint(note, key.public_key(), "other.org/log")


def test_cosignature_round_trip_and_tampering() -> None:
    log_key, witness = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    note = sign_checkpoint("example.com/log", 7, bytes(32), log_key)
    cosigned = add_cosignature(note, "witness.example", witness, 1_764_576_000)
    assert cosignature_time(cosigned, "witness.example", witness.public_key()) == 1_764_576_000
    assert verify_checkpoint(cosigned, log_key.public_key()).size == 7  # still the log's
    with pytest.raises(NoteError):
        cosignature_time(note, "witness.example", witness.public_key())
    moved = cosigned.replace("\n7\n", "\n8\n")
    with pytest.raises(NoteError):
        cosignature_time(moved, "witness.example", witness.public_key())
