"""Telemetry that stays inside the network: logs, traces, metrics, and the egress guard."""
