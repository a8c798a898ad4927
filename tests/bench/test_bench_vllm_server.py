"""The bench's vLLM servers run with vLLM's own OpenMP waiting, not our engine's."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine  # noqa: F401  (sets OMP_WAIT_POLICY=PASSIVE in this process, as specgate does)
from bench.vllm_server import VllmServer


def test_a_vllm_server_does_not_inherit_the_engines_openmp_waiting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    env = VllmServer(tmp_path, "m", tmp_path / "log").environment()
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env
    assert env["PATH"]  # the rest is inherited


def test_a_vllm_server_gets_the_waiting_it_is_given(tmp_path: Path) -> None:
    env = VllmServer(tmp_path, "m", tmp_path / "log", omp_wait_policy="PASSIVE").environment()
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
