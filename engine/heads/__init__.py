"""Draft heads that speculate from the target's own hidden states (Medusa)."""
