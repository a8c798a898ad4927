"""The speculation method registry (engine.speculation.methods): a method is one module that
registers its name, its vLLM names, its options, its artefact and its proposer factory, and nothing
else needs to change. The fake ``echo`` method below is registered here, in the test, and is then
served by the engine and the gateway end to end: configured, listed, decoded, recorded."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import torch
from pydantic import BaseModel, ConfigDict, Field

from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig, SpeculativeConfig, speculative_config_from_vllm
from engine.models.versioning import model_version, write_manifest
from engine.serving.service import Engine
from engine.speculation import methods
from engine.speculation.logits_processors import LogitsProcessing
from engine.speculation.methods import (
    Artefact,
    ArtefactSpec,
    LoadContext,
    LoadedMethod,
    MethodSpec,
    register,
    unregister,
)
from engine.speculation.proposers.base import Proposal, TokenProposer
from gateway.audit.schema import audit_events
from gateway.backends.vllm import served_artefacts, specgate_method
from tests.api_harness import fresh_database, gateway_settings, live_gateway
from tests.tiny_models import build_pair

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
ECHO_FILE = "echo.json"


class EchoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    echo_span: int = Field(default=1, ge=1, description="Tokens repeated per proposal.")


class EchoProposer(TokenProposer):
    """Proposes the context's last ``span`` tokens again (a deterministic chain)."""

    method = "echo"
    proposes_trees = False
    most_tokens: int | None = None

    def __init__(self, span: int) -> None:
        self.span = span
        self.started = 0

    def start(self, prompt_ids: list[int]) -> None:
        self.started += 1

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        min_confidence: float = 0.0,
        processing: LogitsProcessing | None = None,
    ) -> Proposal:
        tail = context[-self.span :]
        return Proposal([tail[i % len(tail)] for i in range(k)])

    def accepted(self, context: list[int]) -> None:
        return None


def _load_echo(context: LoadContext) -> LoadedMethod:
    directory = context.artefact_dir(ECHO)
    assert directory is not None
    options = context.config.speculative.options_for("echo")
    assert isinstance(options, EchoOptions)
    span = options.echo_span
    return LoadedMethod(
        lambda: EchoProposer(span),
        (Artefact("echo_table", directory.name, model_version(directory)),),
    )


ECHO = MethodSpec(
    name="echo",
    vllm_names=("echo_vllm",),
    options=EchoOptions,
    artefact=ArtefactSpec("echo_table", "heads", "echo table"),
    recognises=lambda directory: (directory / ECHO_FILE).is_file(),
    load=_load_echo,
)


@pytest.fixture(scope="module")
def echo_method() -> Iterator[MethodSpec]:
    register(ECHO)
    yield ECHO
    unregister("echo")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("registry")
    target, draft = build_pair(root)
    table = root / "echo-table"
    table.mkdir()
    (table / ECHO_FILE).write_text(json.dumps({"span": 2}))
    return target, draft, table


# --- the registry itself ------------------------------------------------------------------


def test_the_built_in_methods_are_registered_by_their_own_modules() -> None:
    names = methods.method_names()
    assert names[0] == "none" and {"ngram", "draft", "medusa"} <= set(names)
    # Listed cheapest first: plain, then methods that load nothing, then those with artefacts.
    assert names.index("ngram") < names.index("draft") < names.index("medusa")
    assert methods.from_vllm_name("draft_model") is methods.spec("draft")
    assert methods.from_vllm_name("lookahead") is None
    assert methods.model_based() == frozenset({"draft"})
    assert methods.spec("medusa").artefact == ArtefactSpec("medusa_heads", "heads", "heads")
    assert methods.spec("none").load is None


def test_a_name_or_a_vllm_name_cannot_be_registered_twice(echo_method: MethodSpec) -> None:
    register(echo_method)  # the same entry again (a module imported twice) is harmless
    with pytest.raises(ValueError, match="registered twice"):
        register(MethodSpec(name="echo", vllm_names=("other",)))
    with pytest.raises(ValueError, match="'ngram' already means 'ngram'"):
        register(MethodSpec(name="echo2", vllm_names=("ngram",)))
    assert "echo2" not in methods.method_names()


def test_unknown_names_and_keys_are_refused_naming_them(echo_method: MethodSpec) -> None:
    with pytest.raises(ValueError, match="unknown speculation method 'lookahead'"):
        SpeculativeConfig(method="lookahead")
    with pytest.raises(ValueError, match="unknown speculation method 'lookahead'"):
        SpeculativeConfig(acceptance_thresholds={"lookahead": 0.5})
    with pytest.raises(ValueError, match="unknown speculative configuration keys: echo_spam"):
        SpeculativeConfig.model_validate({"echo_spam": 2})
    with pytest.raises(ValueError, match="echo_span"):
        SpeculativeConfig.model_validate({"echo_span": 0})


def test_a_registered_methods_options_sit_flat_in_the_config_with_defaults(
    echo_method: MethodSpec,
) -> None:
    config = SpeculativeConfig.model_validate({"method": "echo", "echo_span": 3})
    dumped = config.model_dump(mode="json")
    assert dumped["echo_span"] == 3 and dumped["medusa_tree"] is None
    assert SpeculativeConfig.model_validate(dumped) == config  # the JSON form reads back
    assert config.options_for("echo") == EchoOptions(echo_span=3)
    assert SpeculativeConfig().options_for("echo") == EchoOptions()
    assert config.options_for("ngram") is None


def test_the_artefact_a_method_needs_is_required_by_its_own_description(
    echo_method: MethodSpec, models: tuple[Path, Path, Path]
) -> None:
    target, _, table = models
    with pytest.raises(ValueError, match="'echo' needs a echo table directory"):
        EngineConfig(target=target, speculative=SpeculativeConfig(method="echo"))
    with pytest.raises(ValueError, match="'draft' needs a draft model directory"):
        EngineConfig(target=target, speculative=SpeculativeConfig(method="draft"))
    spec, model = speculative_config_from_vllm({"method": "echo_vllm", "model": str(table)})
    assert (spec.method, model) == ("echo", table)
    with pytest.raises(ValueError, match="needs 'model'"):
        speculative_config_from_vllm({"method": "echo_vllm"})


def test_the_default_method_is_the_one_whose_artefact_is_given(
    echo_method: MethodSpec, models: tuple[Path, Path, Path]
) -> None:
    _, draft, table = models
    assert methods.default_method({"heads": table}) == "echo"  # medusa does not claim it
    assert methods.default_method({"draft": draft, "heads": table}) == "draft"
    unclaimed = methods.default_method({"heads": draft})  # nobody claims it: the first listed
    assert unclaimed is not None
    assert methods.spec(unclaimed).artefact.config_field == "heads"  # type: ignore[union-attr]
    assert methods.default_method({}) is None


# --- a registered method served end to end --------------------------------------------------


def test_the_engine_serves_a_method_registered_elsewhere(
    echo_method: MethodSpec, models: tuple[Path, Path, Path]
) -> None:
    target, _, table = models
    config = EngineConfig(
        target=target,
        heads=table,
        dtype="float32",
        speculative=SpeculativeConfig.model_validate(
            {"method": "echo", "echo_span": 2, "min_speedup": 0.0}
        ),
    )
    engine = Engine.load(config)
    try:
        assert engine.available_methods == ("none", "ngram", "echo")
        version = model_version(table)
        assert engine.artefacts == (
            {"kind": "echo_table", "name": "echo-table", "version": version},
        )
        prompt = tuple(engine.tokenizer.encode("def add(a, b):\n    return a + b\n"))
        plain = engine.generate(
            GenerationRequest(prompt, GREEDY, SpeculativeChoice("none"))
        )
        for k in (None, 1, 4):
            echoed = engine.generate(
                GenerationRequest(prompt, GREEDY, SpeculativeChoice("echo", k))
            )
            assert echoed.token_ids == plain.token_ids  # greedy: token for token
            assert echoed.stats.method == "echo"
            if k is not None:
                assert echoed.stats.num_drafts > 0
                assert echoed.stats.num_draft_tokens <= k * echoed.stats.num_drafts
    finally:
        engine.close()


def _events(db: sa.Engine, kind: str) -> list[dict[str, Any]]:
    with db.connect() as connection:
        rows = connection.execute(
            sa.select(audit_events.c.payload)
            .where(audit_events.c.kind == kind)
            .order_by(audit_events.c.seq)
        )
        return [row.payload for row in rows]


def test_the_gateway_lists_serves_and_audits_a_method_registered_elsewhere(
    echo_method: MethodSpec, models: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    target, draft, table = models
    version = model_version(table)
    with fresh_database() as (name, url):
        settings = gateway_settings(
            (target, draft), tmp_path / "data", url, heads=table, method="echo"
        )
        with live_gateway(settings, name) as gateway:
            headers = {"authorization": f"Bearer {gateway.keys['app']}"}
            card = httpx.get(f"{gateway.base_url}/v1/models", headers=headers).json()["data"][0]
            assert card["speculative_methods"] == ["none", "ngram", "draft", "echo"]
            assert {"kind": "echo_table", "name": "echo-table", "version": version} in card[
                "artefacts"
            ]
            body = {
                "model": "target",
                "prompt": "def add(a, b):",
                "max_tokens": 12,
                "temperature": 0,
                "speculative": {"method": "echo", "num_speculative_tokens": 2},
            }
            reply = httpx.post(
                f"{gateway.base_url}/v1/completions", json=body, headers=headers, timeout=60
            )
            assert reply.status_code == 200, reply.text
            speculative = reply.json()["speculative"]
            assert speculative["method"] == "echo" and speculative["num_drafts"] > 0
            plain = httpx.post(
                f"{gateway.base_url}/v1/completions",
                json={**body, "speculative": False},
                headers=headers,
                timeout=60,
            )
            assert plain.json()["choices"][0]["text"] == reply.json()["choices"][0]["text"]
            db = gateway.services.db
            (startup,) = _events(db, "startup")
            assert startup["speculative_config"]["method"] == "echo"
            assert startup["speculative_config"]["echo_span"] == 1
            request_event = _events(db, "request")[0]
            assert "draft_version" not in request_event
            assert {"kind": "echo_table", "name": "echo-table", "version": version} in (
                request_event["artefacts"]
            )
            deadline = time.monotonic() + 30
            while not _events(db, "completion") and time.monotonic() < deadline:
                time.sleep(0.1)
            completion = _events(db, "completion")[0]
            assert completion["speculative"]["method"] == "echo"
            assert completion["speculative"]["num_drafts"] == speculative["num_drafts"]


def test_a_vllm_server_s_method_and_model_are_named_through_the_registry(
    echo_method: MethodSpec, tmp_path: Path
) -> None:
    table = tmp_path / "echo-table"
    table.mkdir()
    (table / ECHO_FILE).write_text(json.dumps({"span": 2}))
    write_manifest(table)
    assert specgate_method({"method": "draft_model", "model": "/m/d"}) == "draft"
    assert specgate_method({"method": "echo_vllm", "model": str(table)}) == "echo"
    assert specgate_method({"method": "mtp"}) == "draft"  # runs a model Specgate does not name
    assert served_artefacts({"method": "echo_vllm", "model": str(table)}) == (
        {"kind": "echo_table", "name": table.name, "version": model_version(table)},
    )
    assert served_artefacts({"method": "ngram"}) == ()
    assert served_artefacts(None) == ()
