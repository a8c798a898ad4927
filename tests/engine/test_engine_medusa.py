"""Medusa heads on a tiny target: trained a few steps here, then lossless in use.

Greedy speculation with the heads' tree must give plain decoding's tokens exactly; sampled
speculation must draw the first two tokens from the target's exact distribution (the
chi-square test of tests/engine/test_engine_sampling.py); heads trained on another version of the
target are refused, naming both versions. The engines run under a clock-free cost model
(tests.heads_harness), so what adaptive k does depends on the heads alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from engine.api.types import (
    MAX_SPECULATIVE_TOKENS,
    GenerationRequest,
    GenerationStats,
    SamplingParams,
    SpeculativeChoice,
)
from engine.models.loading import load_model, load_tokenizer
from engine.models.model_runner import ModelRunner
from engine.models.versioning import model_version
from engine.serving.service import Engine
from engine.speculation import request as speculation
from engine.speculation.adaptive import PassCosts, SpeculationLength
from engine.speculation.proposers.base import Proposer
from engine.speculation.proposers.medusa import (
    DEFAULT_MEDUSA_TREE,
    MedusaProposer,
    check_tree,
    sparse_tree,
    tree_expected_tokens,
)
from engine.speculation.request import Speculation
from engine.training.heads import data as heads_data
from engine.training.heads.medusa import HeadsMismatchError, MedusaHeads, load_heads
from engine.training.heads.train import (
    HeadsSpec,
    build_data,
    medusa_accuracy,
    medusa_rank_accuracy,
    medusa_rows,
    split_sequences,
    train_medusa,
)
from tests.decode_alone import decode_alone
from tests.heads_harness import (
    PROMPTS,
    assert_sampling_is_exact,
    greedy_equals_plain,
    heads_engine,
    quiet,
    record_proposed_tokens,
    side_branch_recorder,
    train_heads_with_cli,
)
from tests.tiny_models import SAMPLE_TEXT, build_model, build_tokenizer

SPEC = HeadsSpec(
    num_heads=3,
    snippets=16,
    prompt_tokens=8,
    answer_tokens=16,
    generation_batch=8,
    steps=30,
    rows_per_step=64,
    lr=1e-2,
)


def _train(
    model: PreTrainedModel, target: Path, spec: HeadsSpec = SPEC
) -> tuple[MedusaHeads, list[float]]:
    version = model_version(target)
    data = build_data(model, load_tokenizer(target), SAMPLE_TEXT, spec, version, quiet)
    return train_medusa(model, data, spec, version, quiet)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("medusa")
    target = build_model(root / "target", build_tokenizer(), seed=0, hidden=64, layers=2)
    model = load_model(target, torch.device("cpu"), "float32")
    heads, losses = _train(model, target)
    assert losses[-1] < losses[0], f"training did not lower the loss: {losses}"
    heads.save(root / "heads")
    return target, root / "heads"


@pytest.fixture(scope="module")
def engine(trained: tuple[Path, Path]) -> Iterator[Engine]:
    with heads_engine(*trained, "medusa") as eng:
        yield eng


def test_training_is_deterministic(trained: tuple[Path, Path], tmp_path: Path) -> None:
    target, heads = trained
    model = load_model(target, torch.device("cpu"), "float32")
    again, _ = _train(model, target)
    again.save(tmp_path / "again")
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (
        heads / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("k", [None, 3, 10, MAX_SPECULATIVE_TOKENS])
def test_greedy_medusa_equals_plain_decoding(
    engine: Engine, k: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    branches: list[bool] = []
    monkeypatch.setattr(speculation, "verify_tree_greedy", side_branch_recorder(branches))
    accepted = greedy_equals_plain(engine, "medusa", k)
    assert accepted > 0, "the heads never got a token accepted: the test proves too little"
    if k == 10:  # adaptive k may stay small; a 10-node tree must have taken a side branch
        assert any(branches), "no accepted path left the first children: trees went untested"


@pytest.mark.slow
def test_sampled_medusa_is_exact(engine: Engine) -> None:
    assert_sampling_is_exact(engine, "medusa")


def test_heads_for_another_target_version_are_refused(trained: tuple[Path, Path]) -> None:
    target, heads = trained
    model = load_model(target, torch.device("cpu"), "float32")
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Module)
    with pytest.raises(HeadsMismatchError) as info:
        load_heads(heads, head, 64, model.config.vocab_size, "sha256:another")
    message = str(info.value)
    assert "sha256:another" in message and model_version(target) in message
    assert "Medusa heads" in message and "specgate heads train --method medusa" in message


def test_heads_for_another_hidden_size_are_refused_naming_both(
    trained: tuple[Path, Path],
) -> None:
    target, heads = trained
    model = load_model(target, torch.device("cpu"), "float32")
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Module)
    vocab = model.config.vocab_size
    with pytest.raises(HeadsMismatchError) as info:
        load_heads(heads, head, 32, vocab, model_version(target))
    assert f"hidden size 64 and vocabulary {vocab}; the target has 32 and {vocab}" in str(
        info.value
    )


def test_medusa_in_a_shared_batch_sees_the_hidden_rows_it_sees_alone(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batched, every Medusa request gets plain decoding's tokens, and its heads are handed
    the same hidden rows, step by step, as when it is served alone."""
    assert engine.batching
    seen: dict[int, list[torch.Tensor]] = {}
    observe = MedusaProposer.observe_hidden

    def recording(self: MedusaProposer, hidden: torch.Tensor) -> None:
        seen.setdefault(id(self), []).append(hidden.clone())
        observe(self, hidden)

    monkeypatch.setattr(MedusaProposer, "observe_hidden", recording)
    texts = PROMPTS
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    built = [
        GenerationRequest(tuple(engine.tokenizer.encode(t)), params, SpeculativeChoice("medusa", 4))
        for t in texts
    ]
    handles = [engine.submit(request) for request in built]
    plain_choice = SpeculativeChoice("none")
    handles.append(engine.submit(GenerationRequest(built[0].prompt_ids, params, plain_choice)))
    batched = [handle.result() for handle in handles]
    in_batch = {rows[0].shape[0]: rows for rows in seen.values()}  # by prompt length - 1
    assert len(in_batch) == len(texts), "give the prompts distinct lengths"
    for request, result in zip(built, batched, strict=False):
        plain = engine.generate(GenerationRequest(request.prompt_ids, params, plain_choice))
        assert result.token_ids == plain.token_ids
        seen.clear()
        stats = GenerationStats(method="medusa", num_prompt_tokens=len(request.prompt_ids))
        prototype = engine._proposers["medusa"]
        assert isinstance(prototype, MedusaProposer)
        proposer = MedusaProposer(prototype.heads, prototype.paths)
        length = SpeculationLength(8, 0.5, PassCosts(), "medusa")
        runner = ModelRunner(engine.target_model)
        prompt = list(request.prompt_ids)
        gen = torch.Generator().manual_seed(0)
        speculation = Speculation(
            proposer, None, length, schedule=tuple(result.stats.proposal_lengths)
        )
        alone = decode_alone(runner, prompt, params, gen, stats, speculation)
        assert alone == list(result.token_ids)
        rows_alone = seen[id(proposer)]
        rows_batched = in_batch[len(prompt) - 1]
        assert len(rows_alone) == len(rows_batched)
        for a, b in zip(rows_alone, rows_batched, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


# A draft vocabulary of 48 of the tiny target's 320 tokens: the heads score those only.
SUBSET_SPEC = dataclasses.replace(SPEC, draft_vocab_size=48)


@pytest.fixture(scope="module")
def subset_trained(
    trained: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    target, _ = trained
    model = load_model(target, torch.device("cpu"), "float32")
    heads, _ = _train(model, target, SUBSET_SPEC)
    out = tmp_path_factory.mktemp("medusa-subset") / "heads"
    heads.save(out)
    return target, out


@pytest.fixture(scope="module")
def subset_engine(subset_trained: tuple[Path, Path]) -> Iterator[Engine]:
    with heads_engine(*subset_trained, "medusa") as eng:
        yield eng


def _subset_of(heads: Path) -> set[int]:
    tensors = load_file(str(heads / "model.safetensors"))
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    ids = (d2t + torch.arange(len(d2t))).tolist()
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == ids
    return set(ids)


def test_a_draft_vocabulary_is_saved_as_d2t_and_t2d(subset_trained: tuple[Path, Path]) -> None:
    target, heads = subset_trained
    config = json.loads((heads / "config.json").read_text())
    assert config["draft_vocab_size"] == 48
    subset = _subset_of(heads)
    assert len(subset) == 48
    model = load_model(target, torch.device("cpu"), "float32")
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Linear)
    loaded = load_heads(heads, head, 64, model.config.vocab_size, model_version(target))
    assert loaded.head.vocabulary is not None
    assert set(loaded.head.vocabulary.tolist()) == subset
    # Its rows are the target's, copied: the logits over the subset are the full head's there.
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.head(hidden), head(hidden)[:, loaded.head.vocabulary], rtol=0, atol=1e-6
        )
    # Extra memory: the heads' parameters and the copied rows, nothing of the target's.
    rows = 48 * 64 * 4
    assert loaded.extra_bytes() == loaded.extra_parameters() * 4 + rows + 48 * 8


def test_an_inconsistent_t2d_is_refused(subset_trained: tuple[Path, Path], tmp_path: Path) -> None:
    target, heads = subset_trained
    tensors = load_file(str(heads / "model.safetensors"))
    tensors["t2d"] = tensors["t2d"].clone()
    tensors["t2d"][int(tensors["t2d"].logical_not().nonzero()[0])] = True
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(tensors, str(broken / "model.safetensors"))
    (broken / "config.json").write_text((heads / "config.json").read_text())
    model = load_model(target, torch.device("cpu"), "float32")
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Module)
    with pytest.raises(HeadsMismatchError, match="t2d does not match d2t"):
        load_heads(broken, head, 64, model.config.vocab_size, model_version(target))


def test_subset_heads_propose_inside_it_and_stay_lossless(
    subset_engine: Engine, subset_trained: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    subset = _subset_of(subset_trained[1])
    proposed = record_proposed_tokens(monkeypatch, MedusaProposer)
    accepted = greedy_equals_plain(subset_engine, "medusa", 8)
    assert proposed and set(proposed) <= subset
    assert accepted > 0, "the subset heads never got a token accepted: the test proves too little"


@pytest.mark.slow
def test_sampled_medusa_with_a_draft_vocabulary_is_exact(subset_engine: Engine) -> None:
    """Chi-square at SIGNIFICANCE (0.001) over SAMPLES draws of the first two tokens: the
    subset limits what the heads propose, never what the target can output."""
    assert_sampling_is_exact(subset_engine, "medusa")


def test_answers_and_features_are_read_back_from_the_cache(
    trained: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second training on the same data (the other method, fewer prompts) reads the
    target's answers and features back instead of running the target again."""
    target, _ = trained
    model = load_model(target, torch.device("cpu"), "float32")
    tokenizer, version = load_tokenizer(target), model_version(target)
    first = build_data(model, tokenizer, SAMPLE_TEXT, SPEC, version, quiet, cache_dir=tmp_path)

    def not_again(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the target ran again despite the cache")

    compute_features = heads_data.features
    monkeypatch.setattr(heads_data, "greedy_answers", not_again)
    monkeypatch.setattr(heads_data, "features", not_again)
    again = build_data(model, tokenizer, SAMPLE_TEXT, SPEC, version, quiet, cache_dir=tmp_path)
    assert torch.equal(first.ids, again.ids) and torch.equal(first.hidden, again.hidden)
    # Fewer snippets are a prefix of the same seeded ones: their answers are cached (their
    # features, of other sequences, are computed).
    monkeypatch.setattr(heads_data, "features", compute_features)
    fewer = dataclasses.replace(SPEC, snippets=SPEC.snippets // 2)
    part = build_data(model, tokenizer, SAMPLE_TEXT, fewer, version, quiet, cache_dir=tmp_path)
    assert torch.equal(part.ids, first.ids[: SPEC.snippets // 2])


def _tiny_data(trained: tuple[Path, Path]) -> tuple[PreTrainedModel, heads_data.Distillation]:
    target, _ = trained
    model = load_model(target, torch.device("cpu"), "float32")
    version = model_version(target)
    return model, build_data(model, load_tokenizer(target), SAMPLE_TEXT, SPEC, version, quiet)


def test_medusa_rows_run_from_the_last_prompt_token_while_every_head_has_a_label(
    trained: tuple[Path, Path],
) -> None:
    _, data = _tiny_data(trained)
    rows = medusa_rows(data, 3)
    for s in range(data.ids.shape[0]):
        last = int(data.lengths[s]) - 2 - 3 + 1
        assert [t for q, t in rows if q == s] == list(range(int(data.own_from[s]) - 1, last))


def test_medusa_accuracy_counts_each_heads_hits_on_the_targets_tokens(
    trained: tuple[Path, Path],
) -> None:
    model, data = _tiny_data(trained)
    heads, _ = train_medusa(model, data, SPEC, model_version(trained[0]), quiet)
    expected = []
    with torch.no_grad():
        for k in range(SPEC.num_heads):
            hits = total = 0
            for s, t in medusa_rows(data, SPEC.num_heads):
                top = int(heads.logits(data.hidden[s, t].clone(), k).argmax())
                hits += int(heads.to_target(torch.tensor(top))) == int(data.ids[s, t + 2 + k])
                total += 1
            expected.append(round(hits / total, 4))
    assert medusa_accuracy(heads, data) == expected
    assert expected[0] > 0, "no head-0 hit at all: the comparison proves too little"


def test_split_sequences_holds_out_every_tenth_sequence(trained: tuple[Path, Path]) -> None:
    _, data = _tiny_data(trained)
    train, held = split_sequences(data, 0.1)
    n = data.ids.shape[0]
    assert held.ids.shape[0] == n // 10 and train.ids.shape[0] == n - n // 10
    assert torch.equal(held.ids, data.ids[9::10]) and torch.equal(held.hidden, data.hidden[9::10])
    kept = torch.arange(n) % 10 != 9
    assert torch.equal(train.ids, data.ids[kept])
    assert torch.equal(train.own_from, data.own_from[kept])


def test_heads_cli_reports_each_medusa_heads_held_out_accuracy(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    target, _ = trained
    out = train_heads_with_cli(
        target, tmp_path, "medusa", "--snippets", "20", "--answer-tokens", "12",
        "--num-heads", "2", "--steps", "3", "--held-out", "0.1",
    )
    accuracy = json.loads((out / "training.json").read_text())["held_out_top1_per_head"]
    assert len(accuracy) == 2 and all(0.0 <= a <= 1.0 for a in accuracy)


def test_adaptive_k_proposes_the_whole_tree_where_its_rows_cost_nothing(engine: Engine) -> None:
    """Every pass costs the same here (``clock_free_costs``) and each node of the tree can
    only add accepted tokens, so adaptive k must propose every node. Modelled as a chain's
    accepted run, k was capped at one node beyond the longest accepted run (at most 5 with 4
    heads) and a tree's first nodes were credited with the whole tree's acceptance. (A step
    proposes at most the tokens left after its own, so the request outlasts the tree.)"""
    params = SamplingParams(max_tokens=2 * MAX_SPECULATIVE_TOKENS, temperature=0.0, ignore_eos=True)
    prompt = tuple(engine.tokenizer.encode(PROMPTS[0]))
    result = engine.generate(GenerationRequest(prompt, params, SpeculativeChoice("medusa")))
    proposer = engine.new_proposer("medusa")
    assert isinstance(proposer, MedusaProposer)
    assert len(proposer.paths) > 5  # the built-in tree's nodes within the tiny heads' depth
    assert max(result.stats.proposal_lengths) == len(proposer.paths)


def test_medusa_rank_accuracy_counts_each_heads_hits_at_each_rank(
    trained: tuple[Path, Path],
) -> None:
    model, data = _tiny_data(trained)
    heads, _ = train_medusa(model, data, SPEC, model_version(trained[0]), quiet)
    table = medusa_rank_accuracy(heads, data, 3)
    rows = medusa_rows(data, SPEC.num_heads)
    with torch.no_grad():
        for k in range(SPEC.num_heads):
            hits = [0, 0, 0]
            for s, t in medusa_rows(data, SPEC.num_heads):
                ranked = torch.topk(heads.logits(data.hidden[s, t].clone(), k), 3).indices
                for r, index in enumerate(heads.to_target(ranked).tolist()):
                    hits[r] += index == int(data.ids[s, t + 2 + k])
            assert table[k] == [round(h / len(rows), 4) for h in hits]
    assert table[0][0] == medusa_accuracy(heads, data)[0] > 0


def _trees(paths: list[tuple[int, ...]], size: int) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Every set of ``size`` paths closed under taking parents, in list order."""
    for chosen in itertools.combinations(paths, size):
        if all(len(p) == 1 or p[:-1] in chosen for p in chosen):
            yield chosen


def test_sparse_tree_is_the_best_tree_of_every_size_and_lists_parents_first() -> None:
    accuracy = [[0.5, 0.2], [0.4, 0.15], [0.3, 0.1]]
    paths = [p for n in (1, 2, 3) for p in itertools.product(range(2), repeat=n)]
    tree = sparse_tree(accuracy, 8)
    check_tree(tree)  # each path after its parent
    assert tree[:3] == ((0,), (0, 0), (1,))  # 0.5, 0.2 and 0.2: ties keep the lower ranks
    for size in range(1, 9):
        best = max(tree_expected_tokens(accuracy, t) for t in _trees(paths, size))
        assert tree_expected_tokens(accuracy, tree[:size]) == pytest.approx(best, abs=1e-12)
    assert tree_expected_tokens(accuracy, ((0,), (0, 0))) == pytest.approx(1 + 0.5 + 0.2)
    start = ((1,), (0,), (1, 1))  # a tree kept as given, then the best nodes around it
    grown = sparse_tree(accuracy, 6, start)
    assert grown[:3] == start and len(set(grown)) == 6
    check_tree(grown)
    holding = [t for t in _trees(paths, 6) if set(start) <= set(t)]
    best = max(tree_expected_tokens(accuracy, t) for t in holding)
    assert tree_expected_tokens(accuracy, grown) == pytest.approx(best, abs=1e-12)


def test_the_built_in_tree_holds_more_nodes_than_16_best_first() -> None:
    check_tree(DEFAULT_MEDUSA_TREE)
    assert len(DEFAULT_MEDUSA_TREE) == MAX_SPECULATIVE_TOKENS > 16


def test_every_proposer_says_in_the_protocol_whether_it_proposes_trees() -> None:
    """``proposes_trees`` and ``most_tokens`` are ``Proposer`` members every proposer
    declares (they were looked up beside the protocol, a chain proposer saying nothing)."""
    from engine.speculation.proposers.draft import DraftProposer
    from engine.speculation.proposers.ngram import NgramProposer
    from engine.speculation.proposers.translating import TranslatingDraftProposer

    assert {"proposes_trees", "most_tokens"} <= set(Proposer.__annotations__)
    for chain in (NgramProposer, DraftProposer, TranslatingDraftProposer):
        assert chain.proposes_trees is False and chain.most_tokens is None


def test_adaptive_k_of_a_tree_is_bounded_by_its_nodes(trained: tuple[Path, Path]) -> None:
    """A 6-node tree under the default bound: adaptive k, the engine-wide node counts and
    the batch's cap stop at 6 nodes, so no step is priced for rows it cannot fill."""
    tree = [[0], [1], [0, 0], [2], [0, 1], [0, 0, 0]]
    with heads_engine(*trained, "medusa", {"medusa_tree": tree}) as engine:
        proposer = engine.new_proposer("medusa")
        assert proposer.proposes_trees and proposer.most_tokens == 6
        assert engine.speculative_config.max_speculative_tokens == MAX_SPECULATIVE_TOKENS
        request = GenerationRequest((1, 2, 3), SamplingParams(max_tokens=8, temperature=0.0))
        plan = engine._plan(request)
        assert plan.speculation is not None and plan.speculation.length.max_k == 6
        assert engine._run_lengths["medusa"].max_k == 6
