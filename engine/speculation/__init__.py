"""Speculative decoding: the method registry and proposers, the proposal tree, verification
and rejection sampling, logits processors, and the adaptive choice of proposal lengths."""
