"""The demo build: a quick build loads with ``from_pretrained``, chats, and is reproducible."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from engine.demo.build import QUICK, build_demo
from engine.demo.cli import models_app
from engine.demo.corpus import is_held_out, load_corpus
from engine.demo.paths import default_demo_dir

BENCH_PROMPTS = Path(__file__).parent.parent / "bench" / "prompts"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    result = CliRunner().invoke(models_app, ["build-demo", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"built {out}/target and {out}/draft" in result.output
    return out


def test_pair_loads_with_from_pretrained_in_the_saved_dtypes(built: Path) -> None:
    target = AutoModelForCausalLM.from_pretrained(built / "target", local_files_only=True)
    draft = AutoModelForCausalLM.from_pretrained(built / "draft", local_files_only=True)
    assert target.config.model_type == draft.config.model_type == "llama"
    assert target.config.vocab_size == draft.config.vocab_size
    assert draft.config.num_hidden_layers < target.config.num_hidden_layers
    # The quick build trains in float32 on every CPU, and saves both models so.
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["target"]["saved_dtype"] == manifest["draft"]["saved_dtype"] == "float32"
    for model in ("target", "draft"):
        tensors = load_file(built / model / "model.safetensors").values()
        assert {t.dtype for t in tensors} == {torch.float32}


def test_a_bfloat16_build_saves_the_target_in_bfloat16(tmp_path: Path) -> None:
    manifest = build_demo(tmp_path, replace(QUICK, bfloat16=True), show_progress=False)
    assert manifest["target"]["saved_dtype"] == "bfloat16"  # type: ignore[index]
    target = load_file(tmp_path / "target" / "model.safetensors").values()
    assert {t.dtype for t in target} == {torch.bfloat16}
    draft = load_file(tmp_path / "draft" / "model.safetensors").values()
    assert {t.dtype for t in draft} == {torch.float32}


def test_tokenizer_has_a_chat_template_and_end_of_turn_ends_generation(built: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built / "target", local_files_only=True)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "print(1)"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|user|>\nprint(1)<|end|>\n<|assistant|>\n"
    code = "def add(a, b):\n    return a + b\n"
    assert tokenizer.decode(tokenizer.encode(code, add_special_tokens=False)) == code
    for model in ("target", "draft"):
        generation = json.loads((built / model / "generation_config.json").read_text())
        assert generation["eos_token_id"] == [
            tokenizer.eos_token_id,
            tokenizer.convert_tokens_to_ids("<|end|>"),
        ]
    assert AutoTokenizer.from_pretrained(built / "draft").get_vocab() == tokenizer.get_vocab()


def test_manifest_records_sizes_steps_losses_and_times(built: Path) -> None:
    manifest = json.loads((built / "manifest.json").read_text())
    target, draft = manifest["target"], manifest["draft"]
    assert target["schedule"]["steps"] == QUICK.target_schedule.steps
    assert draft["schedule"]["steps"] == QUICK.draft_schedule.steps
    assert draft["parameters"] < target["parameters"]
    assert len(target["train_loss_every_10_steps"]) == QUICK.target_schedule.steps // 10
    assert len(draft["distillation_kl_every_10_steps"]) == QUICK.draft_schedule.steps // 10
    assert 0.0 <= manifest["evaluation"]["greedy_agreement"] <= 1.0
    for measure in ("target_quoting_accuracy", "target_quote_exact_prefix",
                    "target_quote_similarity"):
        assert 0.0 <= manifest["evaluation"][measure] <= 1.0
    assert manifest["corpus"]["quoting_chats"] > 0
    assert set(manifest["seconds"]) == {
        "corpus", "tokenizer", "target_training", "draft_distillation", "evaluation", "save",
        "total",
    }
    assert manifest["corpus"]["train_files"] + len(manifest["corpus"]["held_out_files"]) == (
        QUICK.max_files
    )


def test_build_is_deterministic(built: Path, tmp_path: Path) -> None:
    build_demo(tmp_path, QUICK, show_progress=False)
    for model in ("target", "draft"):
        first = load_file(built / model / "model.safetensors")
        second = load_file(tmp_path / model / "model.safetensors")
        assert first.keys() == second.keys()
        assert all(torch.equal(first[name], second[name]) for name in first)
        assert (built / model / "tokenizer.json").read_text() == (
            tmp_path / model / "tokenizer.json"
        ).read_text()


def test_bench_prompts_come_from_files_the_build_holds_out() -> None:
    corpus = load_corpus()
    held_out = {f.relative_path for f in corpus.held_out}
    trained = {f.relative_path for f in corpus.train}
    sources = [
        json.loads(line)["source"].split(":")[0]
        for path in sorted(BENCH_PROMPTS.glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert len(sources) == 16
    assert all(is_held_out(source) for source in sources)
    assert set(sources) <= held_out
    assert not set(sources) & trained


def test_default_demo_dir_follows_xdg_cache_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_demo_dir() == tmp_path / "specgate" / "demo"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_demo_dir() == tmp_path / "home" / ".cache" / "specgate" / "demo"
