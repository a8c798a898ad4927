"""Offline check of a receipt (``GET /v1/audit/proof/{event_id}``): the event, a checkpoint
signed by the gateway and the RFC 9162 inclusion proof of the event's leaf in it. Standard
library plus ``cryptography`` only."""

from __future__ import annotations

from typing import Any

from gateway.audit.merkle import ProofError, leaf_hash, verify_inclusion
from gateway.audit.note import NoteError, verify_checkpoint
from gateway.audit.records import EventRecord, RecordFormatError, b64, unb64_hash
from gateway.audit.signing import load_public_key


class ReceiptError(ValueError):
    """The receipt does not prove what it claims; the message says why."""


def verify_receipt(
    receipt: dict[str, Any], public_key_pem: bytes, expected_leaf_hash: str | None = None
) -> str:
    """A one-line statement of what the receipt proves; raises ReceiptError (or
    PublicKeyError for a bad key). ``expected_leaf_hash``: the base64 leaf hash the app was
    given in the response header, which the receipt's event must match."""
    key = load_public_key(public_key_pem)
    try:
        checkpoint = verify_checkpoint(str(receipt["checkpoint"]), key)
        event = EventRecord(**receipt["event"])
        proof = [unb64_hash(h) for h in receipt["inclusion_proof"]]
        index, size = receipt["leaf_index"], receipt["tree_size"]
    except (KeyError, TypeError, NoteError, RecordFormatError) as exc:
        raise ReceiptError(
            f"the receipt is malformed or its checkpoint is not signed: {exc}"
        ) from None
    if not isinstance(index, int) or index != event.leaf_index:
        raise ReceiptError(f"leaf index {index} is not that of event {event.seq}")
    if size != checkpoint.size:
        raise ReceiptError(f"tree size {size} is not the checkpoint's ({checkpoint.size})")
    if event.computed_hash() != event.event_hash:
        raise ReceiptError(f"event {event.seq} was altered: its event_hash does not recompute")
    leaf = leaf_hash(event.canonical_bytes())
    if expected_leaf_hash is not None and b64(leaf) != expected_leaf_hash:
        raise ReceiptError("the event is not the one the response's leaf hash names")
    try:
        verify_inclusion(index, checkpoint.size, leaf, proof, checkpoint.root)
    except ProofError as exc:
        raise ReceiptError(f"event {event.seq} is not in the signed tree: {exc}") from None
    return (
        f"event {event.seq} ({event.event_id}, {event.kind}) is leaf {index} of the tree of "
        f"{checkpoint.size} events signed by {checkpoint.origin}"
    )
