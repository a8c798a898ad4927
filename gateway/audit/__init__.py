"""The tamper-evident audit log: append-only events, each MAC'd and chained and a leaf of an
RFC 9162 Merkle tree; C2SP signed checkpoints the gateway signs only over a history that
extends its previous one; proofs, receipts, export, the witness and offline verification
(``merkle``, ``note``, ``mac``, ``records``, ``verify``, ``receipt`` and ``witness`` need only
the standard library and ``cryptography``)."""
