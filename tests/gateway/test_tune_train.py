"""``specgate tune train``: the company of test_tune.py (one subject erased, one held) serves
a tiny target with weak Medusa heads; heads retrained on its recorded traffic are measured on
held-out requests and promoted into the configuration only where they do better. The run is
audited before any content is read, the artefact carries its provenance and is the same for
the same seed, an EAGLE draft comes out in vLLM's speculators format, and a draft model
distilled on the same traffic serves as the engine's draft and is promoted only where better."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from bench.variants import Generator, Run
from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig
from engine.models.loading import load_model
from engine.models.versioning import model_version
from engine.serving.service import Engine
from engine.speculation.proposers.vocabulary import VOCABULARY_FILE
from engine.training.demo.draft import DraftSpec
from engine.training.heads.medusa import MedusaConfig, MedusaHeads
from gateway.cli import app as specgate_cli
from gateway.tune.train import verdict
from tests.gateway.test_tune import CANARY, Company, _events, recorded_company
from tests.heads_harness import FLAT_PASS_SECONDS
from tests.tiny_models import build_model, build_noisy_copy, build_tokenizer

TRAIN = ["--num-heads", "2", "--answer-tokens", "16", "--generation-batch", "8",
         "--rows-per-step", "64", "--draft-vocab-size", "0", "--lr", "1e-2",
         "--max-tokens", "8", "--k", "2", "--held-out", "0.3"]


def _weak_heads(target: Path, out: Path) -> None:
    """What the configuration serves before retraining: Medusa heads that score only the 32
    tokens of the target's smallest output rows, which its greedy answers never hold."""
    model = load_model(target, torch.device("cpu"), "float32")
    lm_head = model.get_output_embeddings()
    assert isinstance(lm_head, torch.nn.Linear)
    quietest = torch.argsort(lm_head.weight.norm(dim=1))[:32].sort().values
    config = MedusaConfig(
        medusa_num_heads=2, medusa_num_layers=1, hidden_size=int(lm_head.weight.shape[1]),
        vocab_size=int(lm_head.weight.shape[0]), target_model_version=model_version(target),
        draft_vocab_size=32,
    )
    MedusaHeads(config, lm_head, vocabulary=quietest).save(out)


@pytest.fixture(scope="module")
def company(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Company]:
    root = tmp_path_factory.mktemp("tune-train")
    target = build_model(root / "target", build_tokenizer(), seed=0, hidden=64, layers=2)
    draft = build_noisy_copy(target, root / "draft", noise=0.3)
    _weak_heads(target, root / "weak-medusa")
    with recorded_company(root, target, draft, root / "weak-medusa", "medusa") as company:
        yield company


@dataclass
class Trained:
    out: Path
    output: str
    provenance: dict[str, Any]
    report: dict[str, Any]


def _train(company: Company, out: Path, *options: str, config: Path | None = None) -> Trained:
    result = CliRunner().invoke(
        specgate_cli,
        ["tune", "train", "--config", str(config or company.config), "--out", str(out),
         *TRAIN, *options],
    )
    assert result.exit_code == 0, result.output
    return Trained(
        out, result.output, json.loads((out / "provenance.json").read_text()),
        json.loads((out / "train.json").read_text()),
    )


@pytest.fixture(scope="module")
def trained(company: Company, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    return _train(company, tmp_path_factory.mktemp("medusa"), "--steps", "40")


def _readable(company: Company) -> set[str]:
    return set(company.ids["alice"] + company.ids["dave"])


def test_the_train_run_is_audited_before_any_content_is_read_and_names_the_subjects(
    company: Company, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.privacy.store import PrivacyStore

    read = PrivacyStore.read_content
    recorded_at_read: list[int] = []

    def reading(self: PrivacyStore, content: dict[str, Any]) -> Any:
        recorded_at_read.append(len(_events(company, "tune_train")))
        return read(self, content)

    before = len(_events(company, "tune_train"))
    monkeypatch.setattr(PrivacyStore, "read_content", reading)
    run = _train(company, tmp_path / "out", "--steps", "2")
    # Every read happened with the run's event already in the log.
    assert recorded_at_read and set(recorded_at_read) == {before + 1}
    (event,) = [e for e in _events(company, "tune_train")
                if e.event_id == run.provenance["train_event_id"]]
    assert event.actor.startswith("cli:")
    refs = company.subject_refs
    assert sorted(event.payload["subject_refs"]) == sorted([refs["alice"], refs["dave"]])
    assert set(event.payload["request_event_ids"]) == _readable(company)
    assert event.payload["skipped"] == {"erased": 7, "legal_hold": 7, "content_not_stored": 2}
    assert event.payload["method"] == "medusa"
    assert event.payload["options"]["recipe"]["heads_spec"]["steps"] == 2
    # Neither the erased nor the held subject's requests are trained or measured on.
    split = run.provenance["split"]
    assert set(split["train"]) | set(split["held_out"]) == _readable(company)
    for user in ("bob", "carol", "erin"):
        assert not set(company.ids[user]) & (set(split["train"]) | set(split["held_out"]))
    assert refs["bob"] not in json.dumps(run.provenance)


def test_the_artefact_has_its_provenance_and_no_content(company: Company, trained: Trained) -> None:
    prov = trained.provenance
    target = Path(yaml.safe_load(company.config.read_text())["target"])
    directory = trained.out / prov["artefact"]["directory"]
    # The directory holds what the engine loads: its version is the recorded content hash.
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == [
        "config.json", "model.safetensors"
    ]
    assert model_version(directory) == prov["artefact"]["content_sha256"]
    assert directory.name == "medusa-" + prov["artefact"]["content_sha256"][7:23]
    assert prov["target_model_version"] == model_version(target)
    assert prov["recipe"]["heads_spec"]["seed"] == prov["split"]["seed"] == 0
    assert prov["recipe"]["heads_spec"]["steps"] == 40
    assert prov["sample"]["source"] == "audit_log"
    assert set(prov["sample"]["requests"]) == _readable(company)
    train, held = set(prov["split"]["train"]), set(prov["split"]["held_out"])
    assert train and held and not train & held
    refs = company.subject_refs
    assert prov["subject_refs_read"] == sorted([refs["alice"], refs["dave"]])
    assert set(prov["subject_refs_trained_on"]) <= set(prov["subject_refs_read"])
    # The target's answers are gone with the run; no file holds a prompt's text.
    assert not (trained.out / "cache").exists()
    for path in trained.out.rglob("*"):
        if path.is_file():
            assert CANARY.encode() not in path.read_bytes(), path
    assert trained.report["provenance_sha256"] == hashlib.sha256(
        (trained.out / "provenance.json").read_bytes()
    ).hexdigest()
    assert set(trained.report["held_out"]["requests"]) == held


def test_the_compliance_report_lists_the_train_run_and_the_content_it_read(
    company: Company, trained: Trained
) -> None:
    from datetime import UTC, datetime, timedelta

    from gateway.privacy.report import collect
    from gateway.privacy.report_html import render_html

    now = datetime.now(UTC)
    data = collect(company.gateway.services.db, now - timedelta(hours=1), now + timedelta(hours=1))
    runs = [r for r in data.tuning_runs if r["run"] == "tune_train"]
    assert runs and all(
        set(r["request_event_ids"]) == set(trained.provenance["sample"]["requests"])
        and r["subject_refs"] == trained.provenance["subject_refs_read"]
        for r in runs
    )
    rows = render_html(data).split("id='tuning-runs'")[1].split("</table>")[0]
    assert "<td>tune_train</td><td>audit_log</td><td>14</td><td>2</td>" in rows
    assert "content_not_stored: 2, erased: 7, legal_hold: 7" in rows


def test_the_same_seed_gives_the_same_artefact_and_a_rerun_reads_the_answers_back(
    company: Company, trained: Trained, tmp_path: Path
) -> None:
    out = tmp_path / "again"
    first = _train(company, out, "--steps", "40", "--keep-cache")
    assert first.provenance["artefact"] == trained.provenance["artefact"]
    assert first.provenance["split"] == trained.provenance["split"]
    assert first.provenance["training"]["answers_read_back"] == 0
    assert (out / "cache").is_dir()
    # Rerun into the same directory: no answer is generated again.
    second = _train(company, out, "--steps", "40")
    training = second.provenance["training"]
    assert training["answers_generated"] == 0
    assert training["answers_read_back"] == len(second.provenance["split"]["train"])
    assert "0 answers generated" in second.output
    assert second.provenance["artefact"] == trained.provenance["artefact"]
    assert not (out / "cache").exists()


def _config_copy(company: Company, tmp_path: Path) -> Path:
    config = tmp_path / "gateway.yaml"
    shutil.copy(company.config, config)
    return config


def _promotions(company: Company, report: dict[str, Any]) -> list[Any]:
    return [e for e in _events(company, "tune_promote")
            if e.payload["train_event_id"] == report["train_event_id"]]


@pytest.fixture
def clock_free_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every replay timed as its target passes at a flat cost each (an accelerator's costs,
    as ``tests.heads_harness.clock_free_costs``), so that tokens/s follow acceptance alone and
    not the load of a shared machine."""
    run = Generator.run

    def by_passes(self: Generator, *args: Any, **kwargs: Any) -> Run:
        done = run(self, *args, **kwargs)
        passes = done.stats.num_target_passes if done.stats is not None else 0
        return dataclasses.replace(done, seconds=FLAT_PASS_SECONDS * max(1, passes))

    monkeypatch.setattr(Generator, "run", by_passes)


@pytest.mark.usefixtures("clock_free_runs")
def test_measure_train_promote_loop_promotes_better_heads(
    company: Company, tmp_path: Path
) -> None:
    config = _config_copy(company, tmp_path)
    measure = CliRunner().invoke(
        specgate_cli,
        ["tune", "measure", "--config", str(config), "--out", str(tmp_path / "before"),
         "--max-tokens", "8", "--k", "2"],
    )
    assert measure.exit_code == 0, measure.output
    before = json.loads((tmp_path / "before" / "tune.json").read_text())
    advice = before["models"][0]["recommendation"]["advice"]
    assert any("medusa" in a and "fine-tune" in a for a in advice), advice
    run = _train(company, tmp_path / "out", "--steps", "200", "--promote", config=config)
    rows = {row["artefact"]: row for row in run.report["rows"]}
    assert set(rows) == {"plain", "current", "retrained"}
    assert rows["retrained"]["acceptance_rate"] > rows["current"]["acceptance_rate"]
    for row in (rows["current"], rows["retrained"]):
        assert row["k"] == 2 and 1.0 <= row["mean_accepted_length"] <= 3.0
        assert row["tokens_per_second"] > 0
    assert run.report["verdict"]["better"] and "promoted" in run.output
    directory = run.out / run.provenance["artefact"]["directory"]
    assert yaml.safe_load(config.read_text())["heads"] == str(directory.resolve())
    (event,) = _promotions(company, run.report)
    payload = event.payload
    assert payload["promoted"] is True and payload["change"] == {"heads": str(directory.resolve())}
    assert payload["report_sha256"] == hashlib.sha256(
        (run.out / "train.json").read_bytes()
    ).hexdigest()
    assert payload["content_sha256"] == run.provenance["artefact"]["content_sha256"]
    assert payload["held_out"]["retrained"]["acceptance_rate"] == rows["retrained"][
        "acceptance_rate"
    ]
    assert payload["held_out"]["current"]["acceptance_rate"] == rows["current"]["acceptance_rate"]
    # Retraining that brings nothing (the same recipe: the same heads) is not promoted, and
    # the file is left alone.
    served = config.read_bytes()
    again = _train(company, tmp_path / "again", "--steps", "200", "--promote", config=config)
    assert again.provenance["artefact"] == run.provenance["artefact"]
    figures = again.report["verdict"]["figures"]
    assert figures["retrained"] == figures["current"] == payload["held_out"]["retrained"]
    assert not again.report["verdict"]["better"] and "not promoted" in again.output
    assert config.read_bytes() == served
    (refused,) = _promotions(company, again.report)
    assert refused.payload["promoted"] is False and "change" not in refused.payload
    assert refused.payload["current"] == str(directory.resolve())
    assert refused.payload["held_out"] == figures
    assert refused.payload["report_sha256"] == hashlib.sha256(
        (again.out / "train.json").read_bytes()
    ).hexdigest()


def test_promotion_needs_both_higher_acceptance_and_a_higher_speedup() -> None:
    def row(artefact: str, acceptance: float | None, speedup: float) -> dict[str, Any]:
        return {"artefact": artefact, "acceptance_rate": acceptance,
                "mean_accepted_length": None, "tokens_per_second": 100 * speedup,
                "speedup": speedup}

    plain = row("plain", None, 1.0)
    better = verdict([plain, row("current", 0.5, 1.4), row("retrained", 0.6, 1.5)])
    assert better["better"] and better["compared_with"] == "current"
    assert "60.0% (retrained) vs 50.0% (current)" in better["reason"]
    for current, retrained in (((0.6, 1.4), (0.5, 1.5)), ((0.5, 1.5), (0.6, 1.4)),
                               ((0.5, 1.4), (0.5, 1.4))):
        refused = verdict([plain, row("current", *current), row("retrained", *retrained)])
        assert not refused["better"], (current, retrained)
    # Without current heads of the method, the new ones must beat plain decoding.
    assert verdict([plain, row("retrained", 0.3, 1.1)])["better"]
    alone = verdict([plain, row("retrained", 0.9, 0.95)])
    assert not alone["better"] and alone["compared_with"] == "plain"


def test_an_eagle_draft_is_written_in_the_speculators_format_and_serves(
    company: Company, tmp_path: Path
) -> None:
    run = _train(company, tmp_path / "out", "--method", "eagle", "--steps", "10")
    directory = run.out / run.provenance["artefact"]["directory"]
    config = json.loads((directory / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle"
    speculators = config["speculators_config"]
    assert speculators["algorithm"] == "eagle"
    assert speculators["proposal_methods"][0]["proposal_type"] == "greedy"
    target = Path(yaml.safe_load(company.config.read_text())["target"])
    assert speculators["verifier"]["name_or_path"] == target.name
    # The configured heads are Medusa: the EAGLE draft is compared with plain decoding.
    assert {row["artefact"] for row in run.report["rows"]} == {"plain", "retrained"}
    assert run.report["verdict"]["compared_with"] == "plain"
    engine = Engine.load(EngineConfig(target=target, heads=directory))
    try:
        assert "eagle" in engine.available_methods
        eagle = next(a for a in engine.artefacts if a["kind"] == "eagle_heads")
        assert eagle["version"] == run.provenance["artefact"]["content_sha256"]
        request = GenerationRequest(
            prompt_ids=(5, 6, 7, 8),
            sampling=SamplingParams(max_tokens=6, temperature=0.0),
            speculative=SpeculativeChoice(method="eagle", num_speculative_tokens=2),
        )
        plain = GenerationRequest(
            prompt_ids=(5, 6, 7, 8), sampling=SamplingParams(max_tokens=6, temperature=0.0)
        )
        assert engine.generate(request).token_ids == engine.generate(plain).token_ids
    finally:
        engine.close()


DRAFT = ["--method", "draft", "--draft-layer", "0", "--steps", "30"]


@pytest.fixture(scope="module")
def drafted(company: Company, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    return _train(company, tmp_path_factory.mktemp("draft"), *DRAFT)


def test_a_draft_model_distilled_on_the_traffic_serves_as_the_engines_draft(
    company: Company, drafted: Trained
) -> None:
    prov = drafted.provenance
    directory = drafted.out / prov["artefact"]["directory"]
    assert prov["artefact"]["method"] == "draft"
    assert directory.name == "draft-" + prov["artefact"]["content_sha256"][7:23]
    assert model_version(directory) == prov["artefact"]["content_sha256"]
    files = {p.name for p in directory.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", VOCABULARY_FILE} <= files
    # The recipe is the draft's: every DraftSpec field, the layers and steps as asked.
    spec = prov["recipe"]["draft_spec"]
    assert set(spec) == {f.name for f in dataclasses.fields(DraftSpec)}
    assert spec["layers"] == [0] and spec["steps"] == 30 and spec["seed"] == 0
    assert prov["split"]["train"] and prov["training"]["answers_generated"] == len(
        prov["split"]["train"]
    )
    assert not (drafted.out / "cache").exists()
    for path in drafted.out.rglob("*"):
        if path.is_file():
            assert CANARY.encode() not in path.read_bytes(), path
    # No draft is configured: the new one is compared with plain decoding alone.
    assert {row["artefact"] for row in drafted.report["rows"]} == {"plain", "retrained"}
    assert drafted.report["method"] == "draft"
    target = Path(yaml.safe_load(company.config.read_text())["target"])
    engine = Engine.load(EngineConfig(target=target, draft=directory))
    try:
        assert "draft" in engine.available_methods
        loaded = next(a for a in engine.artefacts if a["kind"] == "draft_model")
        assert loaded["version"] == prov["artefact"]["content_sha256"]
        sampling = SamplingParams(max_tokens=6, temperature=0.0)
        drafting = GenerationRequest(
            prompt_ids=(5, 6, 7, 8), sampling=sampling,
            speculative=SpeculativeChoice(method="draft", num_speculative_tokens=2),
        )
        plain = GenerationRequest(prompt_ids=(5, 6, 7, 8), sampling=sampling)
        assert engine.generate(drafting).token_ids == engine.generate(plain).token_ids
    finally:
        engine.close()


@pytest.mark.usefixtures("clock_free_runs")
def test_a_better_draft_is_promoted_and_the_same_one_again_is_not(
    company: Company, drafted: Trained, tmp_path: Path
) -> None:
    config = _config_copy(company, tmp_path)
    assert "draft" not in yaml.safe_load(config.read_text())
    run = _train(company, tmp_path / "out", *DRAFT, "--promote", config=config)
    # The same seed: the same draft, bit for bit.
    assert run.provenance["artefact"] == drafted.provenance["artefact"]
    directory = (run.out / run.provenance["artefact"]["directory"]).resolve()
    assert run.report["verdict"]["better"] and "promoted" in run.output
    written = yaml.safe_load(config.read_text())
    assert written["draft"] == str(directory) and written["method"] == "medusa"
    (event,) = _promotions(company, run.report)
    assert event.payload["promoted"] is True and event.payload["method"] == "draft"
    assert event.payload["change"] == {"draft": str(directory)}
    # Now compared with the configured draft, which it is: not better, the file left alone.
    served = config.read_bytes()
    again = _train(company, tmp_path / "again", *DRAFT, "--promote", config=config)
    assert again.provenance["artefact"] == run.provenance["artefact"]
    rows = {row["artefact"] for row in again.report["rows"]}
    assert rows == {"plain", "current", "retrained"}
    assert not again.report["verdict"]["better"] and "not promoted" in again.output
    assert config.read_bytes() == served
    (refused,) = _promotions(company, again.report)
    assert refused.payload["promoted"] is False and refused.payload["current"] == str(directory)
