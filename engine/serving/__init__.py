"""Serving requests: the engine service, its scheduler (continuous batching) and the one
decode step every request runs, and the output assembly."""
