"""Speed settings of the engine: passive OpenMP threads, and ``--dtype auto`` measured."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import engine.dtype_choice as dtype_choice
import engine.loading as loading


def test_the_specgate_command_makes_openmp_threads_wait_passively() -> None:
    code = (
        "import os, sys; import gateway.cli; "
        "assert 'torch' not in sys.modules; print(os.environ['OMP_WAIT_POLICY'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "PASSIVE"


@pytest.mark.parametrize("slower", [torch.bfloat16, torch.float32])
def test_auto_dtype_is_the_one_measured_faster(
    monkeypatch: pytest.MonkeyPatch, slower: torch.dtype
) -> None:
    measured: list[tuple[torch.dtype, int]] = []

    def seconds(weights: list[torch.Tensor], rows: int) -> float:
        measured.append((weights[0].dtype, rows))
        return 2.0 if weights[0].dtype == slower else 1.0

    monkeypatch.setattr(dtype_choice, "_seconds", seconds)
    dtype_choice.faster_cpu_dtype.cache_clear()
    try:
        chosen = dtype_choice.faster_cpu_dtype(64, 128, verify_tokens=5)
    finally:
        dtype_choice.faster_cpu_dtype.cache_clear()
    assert chosen != slower and chosen in dtype_choice.CANDIDATES
    assert sorted(measured, key=str) == sorted(
        [(d, rows) for d in dtype_choice.CANDIDATES for rows in (1, 5)], key=str
    )


def test_pick_dtype_measures_large_models_on_cpus_with_native_bfloat16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[int, int]] = []

    def faster(hidden: int, intermediate: int) -> torch.dtype:
        asked.append((hidden, intermediate))
        return torch.float32

    monkeypatch.setattr(loading, "faster_cpu_dtype", faster)
    monkeypatch.setattr(loading, "cpu_has_native_bfloat16", lambda: True)
    config = type("Config", (), {"hidden_size": 576, "intermediate_size": 1536})()
    cpu = torch.device("cpu")
    big = loading.SMALL_MODEL_PARAMETERS
    assert loading.pick_dtype("auto", cpu, big, config) == torch.float32  # type: ignore[arg-type]
    assert asked == [(576, 1536)]
    assert loading.pick_dtype("auto", cpu, big - 1, config) == torch.float32  # type: ignore[arg-type]
    assert loading.pick_dtype("bfloat16", cpu, big, config) == torch.bfloat16  # type: ignore[arg-type]
    assert asked == [(576, 1536)]
    monkeypatch.setattr(loading, "cpu_has_native_bfloat16", lambda: False)
    assert loading.pick_dtype("auto", cpu, big, config) == torch.float32  # type: ignore[arg-type]
    assert asked == [(576, 1536)]
