"""Privacy by design: content encrypted outside the chain, keyed commitments, erasure by
crypto-shredding, retention and legal holds (docs/compliance.md)."""
