"""What a backend offers beyond generating is part of the backend protocol, with None as the
answer of a backend that does not offer it; the gateway asks the protocol, never probes."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gateway.backends.base import GenerationBackend
from gateway.backends.local import LocalBackend
from gateway.backends.vllm import VllmBackend

OFFERS = ("speculation_crossover", "speculation_speedup", "divergence")
GATEWAY = Path(__file__).resolve().parents[2] / "gateway"


def test_the_protocol_declares_each_offer() -> None:
    for name in OFFERS:
        assert isinstance(vars(GenerationBackend).get(name), property), name


def test_vllm_offers_neither() -> None:
    backend: Any = object.__new__(VllmBackend)
    assert backend.speculation_crossover is None
    assert backend.speculation_speedup is None
    assert backend.divergence is None


def test_the_local_engine_offers_both() -> None:
    backend: Any = object.__new__(LocalBackend)
    backend.engine = SimpleNamespace(
        speculation_crossover=lambda method: 3.5, estimated_speedup=lambda *figures: 1.25
    )
    assert backend.speculation_crossover("ngram") == 3.5
    assert backend.speculation_speedup("ngram", 8, 4, 2, 6) == 1.25
    assert callable(backend.divergence)


def test_no_gateway_code_probes_a_backend_with_getattr() -> None:
    probes = [
        f"{path.relative_to(GATEWAY)}: {line.strip()}"
        for path in GATEWAY.rglob("*.py")
        for line in path.read_text("utf-8").splitlines()
        if re.search(r"getattr\(\s*(self\.)?(backend|inner|model\.backend)\b", line)
    ]
    assert probes == []
