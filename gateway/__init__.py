"""Specgate's HTTP gateway: OpenAI-compatible API, keys and roles, audit log, telemetry."""
