"""Gateway configuration (`specgate serve`): sources and their order, errors that name the
field, the demo-pair default, and the per-request speculation choice."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import typer
from hypothesis import given
from hypothesis import strategies as st
from pydantic import SecretStr
from structlog.testing import capture_logs
from typer.testing import CliRunner

from gateway.app import load_local_backend
from gateway.backends.base import BackendCard
from gateway.backends.local import LocalBackend
from gateway.cli_serve import serve
from gateway.errors import APIError
from gateway.generation.job import speculative_choice
from gateway.notes import DEMO_DRAFT_MISSING, serving_notes
from gateway.schemas import SpeculativeRequest
from gateway.settings import ConfigError, Settings, engine_config, load_settings


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in [name for name in os.environ if name.startswith("SPECGATE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data-home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache-home"))


def fake_model(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    return directory


def test_flags_beat_environment_beat_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "specgate.yaml"
    config.write_text("port: 9000\nhost: 0.0.0.0\nmethod: ngram\nmax_queue: 5\n")
    monkeypatch.setenv("SPECGATE_PORT", "9100")
    monkeypatch.setenv("SPECGATE_MAX_QUEUE", "7")
    settings = load_settings(config, port=9200, method=None)
    assert (settings.port, settings.max_queue, settings.host, settings.method) == (
        9200,
        7,
        "0.0.0.0",
        "ngram",
    )


def test_defaults_live_in_the_data_directory(tmp_path: Path) -> None:
    settings = load_settings()
    data = tmp_path / "data-home" / "specgate"
    assert settings.data_dir == data
    assert settings.database_url == f"sqlite:///{data}/audit.db"
    assert settings.signing_key_path == data / "audit-signing-key.pem"
    moved = load_settings(data_dir=tmp_path / "elsewhere")
    assert moved.database_url == f"sqlite:///{tmp_path}/elsewhere/audit.db"


@pytest.mark.parametrize(
    ("yaml_text", "field"),
    [
        ("port: eighty\n", "port"),
        ("method: lookahead\n", "method"),
        ("prot: 80\n", "prot"),
        ("database_url: mysql://db/audit\n", "database_url"),
        ('speculative_config: \'{"method": "medusa"}\'\n', "speculative_config"),
        ("num_speculative_tokens: 0\n", "num_speculative_tokens"),
        ("checkpoint_interval_s: 0\n", "checkpoint_interval_s"),
    ],
)
def test_invalid_configuration_names_the_field(tmp_path: Path, yaml_text: str, field: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    with pytest.raises(ConfigError) as raised:
        load_settings(config)
    assert str(raised.value).startswith(f"invalid configuration: {field}:")


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config: file .*nowhere\.yaml does not exist"):
        load_settings(tmp_path / "nowhere.yaml")


@given(port=st.integers())
def test_any_port_outside_the_tcp_range_is_refused(port: int) -> None:
    if 1 <= port <= 65535:
        assert load_settings(port=port).port == port
    else:
        with pytest.raises(ConfigError, match=r"^invalid configuration: port:"):
            load_settings(port=port)


def test_snapshot_hides_secrets() -> None:
    settings = Settings(
        database_url="postgresql://specgate:hunter2@db:5432/audit",
        bootstrap_admin_key=SecretStr("sg-secret-admin"),
    )
    snapshot = settings.public_snapshot()
    text = json.dumps(snapshot)
    assert "hunter2" not in text and "sg-secret-admin" not in text
    assert snapshot["database_url"] == "postgresql://specgate:***@db:5432/audit"
    assert snapshot["bootstrap_admin_key_set"] is True


def test_no_target_serves_the_demo_pair(tmp_path: Path) -> None:
    demo = tmp_path / "cache-home" / "specgate" / "demo"
    with pytest.raises(ConfigError, match="specgate models build-demo") as raised:
        engine_config(load_settings())
    assert str(raised.value).startswith("target:")
    fake_model(demo / "target")
    # Until the draft is distilled the demo target serves with n-gram lookup.
    without_draft = engine_config(load_settings())
    assert (without_draft.target, without_draft.draft, without_draft.speculative.method) == (
        demo / "target",
        None,
        "ngram",
    )
    fake_model(demo / "draft")
    config = engine_config(load_settings())
    assert (config.target, config.draft, config.speculative.method) == (
        demo / "target",
        demo / "draft",
        "draft",
    )
    assert config.served_model_name == "specgate-demo"


def test_the_demo_without_its_draft_says_how_to_build_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    demo = tmp_path / "cache-home" / "specgate" / "demo"
    fake_model(demo / "target")
    loaded: list[Any] = []
    monkeypatch.setattr(
        LocalBackend, "load", classmethod(lambda cls, config, on_fallback: loaded.append(config))
    )

    def warnings() -> list[str]:
        with capture_logs() as logs:
            load_local_backend(load_settings(), lambda event: None)
        return [entry["event"] for entry in logs if entry["log_level"] == "warning"]

    assert warnings() == ["demo_draft_missing"]
    card = BackendCard(  # what /readyz and /v1/models show comes from this
        model_name="m",
        target_version="v",
        max_context=64,
        vocab_size=64,
        available_methods=("none", "ngram"),
        speculative_config={},
        default_method="ngram",
        default_num_speculative_tokens=None,
    )
    assert serving_notes(load_settings(), card) == [DEMO_DRAFT_MISSING]
    with_draft = dataclasses.replace(
        card, artefacts=({"kind": "draft_model", "name": "draft", "version": "sha256:d"},)
    )
    assert serving_notes(load_settings(), with_draft) == []
    assert "specgate models build-demo" in DEMO_DRAFT_MISSING
    fake_model(demo / "draft")
    assert warnings() == []
    assert [config.draft for config in loaded] == [None, demo / "draft"]
    assert serving_notes(load_settings(target=demo / "target"), card) == []


def test_engine_configuration_from_flags_and_vllm_json(tmp_path: Path) -> None:
    target, draft = fake_model(tmp_path / "t"), fake_model(tmp_path / "d")
    plain = engine_config(load_settings(target=target))
    assert (plain.draft, plain.speculative.method) == (None, "none")
    vllm = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    config = engine_config(load_settings(target=target, speculative_config=vllm))
    assert (config.draft, config.speculative.method, config.speculative.num_speculative_tokens) == (
        draft,
        "draft",
        3,
    )
    overridden = engine_config(
        load_settings(target=target, speculative_config=vllm, method="ngram")
    )
    assert overridden.speculative.method == "ngram"
    with pytest.raises(ConfigError, match=r"^method: 'draft' needs a draft model"):
        engine_config(load_settings(target=target, method="draft"))
    with pytest.raises(ConfigError, match=r"^draft: .* is not a model directory"):
        engine_config(load_settings(target=target, draft=tmp_path / "missing"))


def test_speculation_tuning_reaches_the_engine(tmp_path: Path) -> None:
    target = fake_model(tmp_path / "t")
    vllm = json.dumps({"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    tuned = engine_config(
        load_settings(
            target=target,
            speculative_config=vllm,
            acceptance_threshold=0.3,
            fallback_window_tokens=32,
            fallback_probe_interval=4,
            disable_by_queue_depth=5,
            max_speculative_tokens=6,
            cpu_threads=1,
        )
    )
    assert tuned.cpu_threads == 1
    tuned_spec = tuned.speculative
    assert (tuned_spec.prompt_lookup_min, tuned_spec.prompt_lookup_max) == (2, 3)
    assert (
        tuned_spec.acceptance_threshold,
        tuned_spec.window_tokens,
        tuned_spec.probe_interval_requests,
    ) == (
        0.3,
        32,
        4,
    )
    assert (tuned_spec.disable_by_queue_depth, tuned_spec.max_speculative_tokens) == (5, 6)
    lookup = engine_config(load_settings(target=target, prompt_lookup_max=7)).speculative
    assert (lookup.prompt_lookup_min, lookup.prompt_lookup_max) == (1, 7)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        engine_config(load_settings(target=target, prompt_lookup_min=5, prompt_lookup_max=2))


def test_serve_stops_on_invalid_configuration_naming_the_field(tmp_path: Path) -> None:
    app = typer.Typer()
    app.command()(serve)
    runner = CliRunner()
    bad_method = runner.invoke(
        app, ["--target", str(fake_model(tmp_path / "t")), "--method", "lookahead"]
    )
    assert bad_method.exit_code == 2
    assert "invalid configuration: method:" in bad_method.output
    no_demo = runner.invoke(app, [])
    assert no_demo.exit_code == 2
    assert "specgate models build-demo" in no_demo.output


def _card_with(methods: tuple[str, ...]) -> BackendCard:
    return cast(BackendCard, SimpleNamespace(available_methods=methods))


@pytest.mark.parametrize(
    ("requested", "expected"),
    [
        (None, (None, None)),
        (True, (None, None)),
        (False, ("none", None)),
        (SpeculativeRequest(method="ngram", num_speculative_tokens=5), ("ngram", 5)),
    ],
)
def test_speculative_field_maps_onto_the_engine_choice(
    requested: Any, expected: tuple[Any, Any]
) -> None:
    choice = speculative_choice(requested, _card_with(("none", "ngram")))
    assert (choice.method, choice.num_speculative_tokens) == expected


def test_an_unloaded_method_is_a_400_naming_it() -> None:
    with pytest.raises(APIError) as raised:
        speculative_choice(SpeculativeRequest(method="draft"), _card_with(("none", "ngram")))
    error = raised.value
    assert (error.status_code, error.param, error.code) == (
        400,
        "speculative.method",
        "method_unavailable",
    )


SPECGATE = Path(sys.executable).with_name("specgate")


@pytest.mark.parametrize(
    ("yaml_text", "where", "problem"),
    [
        ("port: 8000\ntarget: [unclosed\n", "line 3, column 1", "expected ',' or ']'"),
        ('port: "8000\n', "line 2, column 1", "found unexpected end of stream"),
        ("port: 8000\n  host: x\n", "line 2, column 7", "mapping values are not allowed here"),
    ],
)
def test_a_yaml_syntax_error_is_one_line_naming_file_line_and_column(
    tmp_path: Path, yaml_text: str, where: str, problem: str
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    with pytest.raises(ConfigError) as raised:
        load_settings(config)
    message = str(raised.value)
    assert message.startswith(f"config: {config}, {where}: ") and problem in message
    assert "\n" not in message


def test_serve_with_a_config_that_is_not_yaml_exits_2_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("port: 8000\ntarget: [unclosed\n")
    served = subprocess.run(
        [str(SPECGATE), "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")},
    )
    assert served.returncode == 2
    assert served.stdout == ""
    assert served.stderr.splitlines() == [
        f"specgate serve: config: {config}, line 3, column 1: expected ',' or ']', but got "
        "'<stream end>' (while parsing a flow sequence)"
    ]


def test_a_config_that_is_not_a_mapping_is_named(tmp_path: Path) -> None:
    config = tmp_path / "list.yaml"
    config.write_text("- port\n- 8000\n")
    with pytest.raises(ConfigError, match=rf"^config: {config} must map setting names to values"):
        load_settings(config)
