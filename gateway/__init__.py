"""Specgate's HTTP gateway: OpenAI-compatible API, keys and roles, audit log, telemetry."""

from importlib.metadata import PackageNotFoundError, version


def specgate_version() -> str:
    """The installed package's version; "unknown" when it runs from a tree not installed."""
    try:
        return version("specgate")
    except PackageNotFoundError:
        return "unknown"
