"""The tamper-evident audit log: a hash-chained, append-only table of events, signed
checkpoints, export for auditors and offline verification."""
