"""The backend seam: only the local backend (and the app's wiring) may reach the engine's
concrete service; everything else in the gateway sees ``gateway.backends.base``. The one
exception outside serving is ``specgate tune``'s offline replay, which loads engines of its
own (the benchmark's loop) to time methods and artefacts the gateway does not serve."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import gateway
from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig
from gateway.backends.base import GenerationBackend
from gateway.backends.local import LocalBackend
from tests.tiny_models import build_model, build_tokenizer

GATEWAY_DIR = Path(gateway.__file__).parent
# The engine's concrete runtime: model loading, the worker thread, the tokenizer object.
CONCRETE_ENGINE_MODULES = frozenset({"engine.serving.service"})
ALLOWED = frozenset({GATEWAY_DIR / "backends" / "local.py", GATEWAY_DIR / "tune" / "measure.py"})


def imported_modules(source: str) -> set[str]:
    """Every module an ``import`` or ``from ... import`` names, TYPE_CHECKING blocks too."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_import_scan_sees_every_form_of_import() -> None:
    source = (
        "import engine.serving.service\n"
        "from engine.serving import service\n"
        "if TYPE_CHECKING:\n    from engine.serving.service import Engine\n"
    )
    assert imported_modules(source) >= {"engine.serving.service", "engine.serving.service.Engine"}
    assert "engine.serving.service" in imported_modules("from engine.serving import service\n")


def test_only_the_local_backend_imports_the_engine_service() -> None:
    offenders = sorted(
        str(path.relative_to(GATEWAY_DIR))
        for path in GATEWAY_DIR.rglob("*.py")
        if path not in ALLOWED
        and any(
            name == module or name.startswith(f"{module}.")
            for name in imported_modules(path.read_text(encoding="utf-8"))
            for module in CONCRETE_ENGINE_MODULES
        )
    )
    assert offenders == []


def tiny_backend(root: Path) -> LocalBackend:
    target = build_model(root / "target", build_tokenizer(), seed=0)
    return LocalBackend.load(EngineConfig(target=target, dtype="float32"))


@pytest.fixture(scope="module")
def local_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBackend]:
    backend = tiny_backend(tmp_path_factory.mktemp("seam"))
    yield backend
    backend.close()


def test_local_backend_card_and_generation_follow_the_engine(local_backend: LocalBackend) -> None:
    backend: GenerationBackend = local_backend
    engine = local_backend.engine
    card = backend.card
    assert (card.model_name, card.target_version) == (engine.model_name, engine.target_version)
    assert card.available_methods == engine.available_methods
    assert card.speculative_config == engine.speculative_config.model_dump(mode="json")
    assert backend.health().ready
    prompt = backend.tokenize("hello world")
    assert prompt == tuple(engine.tokenizer.encode("hello world"))
    request = GenerationRequest(
        prompt_ids=prompt,
        sampling=SamplingParams(max_tokens=6, temperature=0.0),
        speculative=SpeculativeChoice(method="none"),
        request_id="seam",
    )
    through_seam, direct = local_backend.submit(request).result(), engine.generate(request)
    assert (through_seam.token_ids, through_seam.text) == (direct.token_ids, direct.text)
    assert through_seam.finish_reason == direct.finish_reason


def test_local_backend_reports_unready_once_closed(tmp_path: Path) -> None:
    backend = tiny_backend(tmp_path)
    backend.close()
    health = backend.health()
    assert not health.ready
    assert health.detail == "the engine is shut down"
