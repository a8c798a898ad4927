"""The stall tests' own PostgreSQL: signalling it survives a backend that exits meanwhile."""

from __future__ import annotations

import subprocess

import pytest

from tests.pg_instance import PgInstance


def _exited_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("action", ["pause", "resume"])
def test_a_backend_gone_between_listing_and_signalling_is_skipped(
    monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    instance = PgInstance(0)
    monkeypatch.setattr(instance, "_pids", lambda: [_exited_pid()])
    try:
        getattr(instance, action)()
    finally:
        instance.remove()
