"""The demo model pair: a byte-level BPE tokenizer and two Llama models trained here."""
