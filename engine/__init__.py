"""Specgate's speculative-decoding engine. Never imports ``gateway``."""
