"""EAGLE-2 on a tiny target: a draft trained a few steps here, then lossless in use.

Greedy speculation with the draft's dynamic tree must give plain decoding's tokens exactly
(adaptive and fixed sizes, and a side branch must have been accepted); sampled speculation
must draw the first two tokens from the target's exact distribution (the chi-square test of
tests/engine/test_engine_sampling.py); the grown tree must be a valid tree ranked by cumulative
draft probability and equal a brute-force EAGLE-2 expansion; the draft's incremental cache
must equal a fresh pass; drafts trained on another version of the target are refused,
naming both versions; training is deterministic for a seed. The engines run under a
clock-free cost model (tests.heads_harness), so what adaptive k does depends on the draft alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import PreTrainedModel

from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig, SpeculativeConfig, speculative_config_from_vllm
from engine.models.loading import load_model, load_tokenizer
from engine.models.versioning import model_version
from engine.serving.service import Engine
from engine.speculation import request as speculation
from engine.speculation.adaptive import PassCosts
from engine.speculation.proposers import eagle as eagle_proposer
from engine.speculation.proposers.eagle import DraftTree, EagleProposer, EagleTree, grow_tree
from engine.speculation.tree import check_parents, children, depths, path_to
from engine.training.heads import heads_method
from engine.training.heads.data import features
from engine.training.heads.eagle import EagleDraft, HeadsMismatchError, load_eagle
from engine.training.heads.train import HeadsSpec, build_data, train_eagle
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
    snippets=16, prompt_tokens=8, answer_tokens=24, generation_batch=8, steps=40, lr=3e-3,
    sequences_per_step=4, token_loss_weight=1.0,
)


def _train(target: Path) -> tuple[EagleDraft, list[float]]:
    model = load_model(target, torch.device("cpu"), "float32")
    version = model_version(target)
    data = build_data(model, load_tokenizer(target), SAMPLE_TEXT, SPEC, version, quiet)
    return train_eagle(model, data, SPEC, version, target.name, quiet)


def _target_and_draft(target: Path, heads: Path) -> tuple[PreTrainedModel, EagleDraft]:
    """The tiny target in float32 and its trained EAGLE draft over its embeddings and head."""
    model = load_model(target, torch.device("cpu"), "float32")
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Module)
    draft = load_eagle(
        heads, model.get_input_embeddings(), head, 64, model.config.vocab_size,
        model_version(target),
    )
    return model, draft


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eagle")
    target = build_model(root / "target", build_tokenizer(), seed=0, hidden=64, layers=2)
    draft, losses = _train(target)
    assert losses[-1] < losses[0], f"training did not lower the loss: {losses}"
    draft.save(root / "heads")
    return target, root / "heads"


@pytest.fixture(scope="module")
def engine(trained: tuple[Path, Path]) -> Iterator[Engine]:
    with heads_engine(*trained, "eagle") as eng:
        yield eng


def test_training_is_deterministic(trained: tuple[Path, Path], tmp_path: Path) -> None:
    target, heads = trained
    again, _ = _train(target)
    again.save(tmp_path / "again")
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (
        heads / "model.safetensors"
    ).read_bytes()


def test_saved_in_speculators_format_and_loads_back(trained: tuple[Path, Path]) -> None:
    target, heads = trained
    config = json.loads((heads / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle"
    assert config["speculators_config"]["algorithm"] == "eagle"
    assert config["speculators_config"]["verifier"]["name_or_path"] == target.name
    assert config["transformer_layer_config"]["hidden_size"] == 64
    assert config["target_model_version"] == model_version(target)
    assert heads_method(heads) == "eagle"

    model = load_model(target, torch.device("cpu"), "float32")
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(head, torch.nn.Module)
    loaded = load_eagle(heads, embed, head, 64, model.config.vocab_size, model_version(target))
    trained_again, _ = _train(target)
    for name, tensor in trained_again.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    features = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0))
    ids, positions = torch.tensor([[5, 6, 7, 8, 9]]), torch.arange(5)
    with torch.inference_mode():
        assert torch.equal(
            loaded(features, ids, positions)[0], trained_again.eval()(features, ids, positions)[0]
        )


def test_heads_for_another_target_version_are_refused(trained: tuple[Path, Path]) -> None:
    target, heads = trained
    model = load_model(target, torch.device("cpu"), "float32")
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Module)
    with pytest.raises(HeadsMismatchError) as info:
        load_eagle(
            heads, model.get_input_embeddings(), head, 64, model.config.vocab_size,
            "sha256:another",
        )
    message = str(info.value)
    assert "sha256:another" in message and model_version(target) in message
    assert "EAGLE heads" in message and "specgate heads train --method eagle" in message


def test_incremental_draft_cache_equals_a_fresh_pass(trained: tuple[Path, Path]) -> None:
    """Features fed in pieces, with a tree proposed (and rolled back) between them, give the
    draft the same prediction as one pass over the whole sequence."""
    target, heads = trained
    model, draft = _target_and_draft(target, heads)
    tokens = load_tokenizer(target).encode("class Point:\n    def __init__(self, x, y):")
    hidden = features(model, [tokens])[0]
    proposer = EagleProposer(draft)
    proposer.start(tokens[:5])
    params = SamplingParams(max_tokens=8, temperature=0.0)
    generator = torch.Generator()
    for end in (5, 6, 9, len(tokens)):
        fed = proposer._fed
        proposer.observe_hidden(hidden[fed : end - 1])
        proposer.propose(tokens[:end], 8, params, generator)
        assert proposer._cache.length == end - 1  # the tree's rows were rolled back
        proposer.accepted(tokens[:end])
    with torch.inference_mode():
        fresh, _, _ = draft(
            hidden[None, :-1], torch.tensor([tokens[1:]]), torch.arange(len(tokens) - 1)
        )
    assert proposer._last is not None
    torch.testing.assert_close(proposer._last, fresh[0, -1], rtol=1e-5, atol=1e-5)


def _fresh_log_probs(
    draft: EagleDraft, tokens: list[int], features: torch.Tensor
) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """The draft's distribution after ``tokens`` plus a path, from cache-less passes over the
    whole sequence: the target's features of the committed positions, then the draft's own
    predicted feature before each path token (what EAGLE feeds at depth 2 and deeper)."""

    @torch.inference_mode()
    def log_probs(path: tuple[int, ...]) -> torch.Tensor:
        fed = list(features[: len(tokens) - 1])
        for depth in range(len(path) + 1):
            ids = torch.tensor([[*tokens[1:], *path[:depth]]])
            out, _, _ = draft(torch.stack(fed)[None], ids, torch.arange(ids.shape[1]))
            fed.append(out[0, -1])
        return torch.log_softmax(draft.logits(fed[-1]).float(), dim=-1)

    return log_probs


@pytest.mark.parametrize(("steps", "topk", "budget"), [(4, 3, 10), (3, 2, 6), (5, 1, 5)])
def test_proposed_tree_equals_eagle2_over_fresh_draft_passes(
    trained: tuple[Path, Path], steps: int, topk: int, budget: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The proposer's tree (one draft pass per level, tree mask, cached prefix) equals
    EAGLE-2's expansion where every path's distribution comes from a fresh pass."""
    target, heads = trained
    model, draft = _target_and_draft(target, heads)
    tokens = load_tokenizer(target).encode("for i in range(10):\n    print(i")
    hidden = features(model, [tokens])[0]
    tree = EagleTree(steps, topk, budget)
    grown: list[DraftTree] = []

    def recording(*args: Any) -> DraftTree:
        grown.append(grow_tree(*args))
        return grown[-1]

    monkeypatch.setattr(eagle_proposer, "grow_tree", recording)
    proposer = EagleProposer(draft, tree)
    proposer.start(tokens)
    proposer.observe_hidden(hidden[: len(tokens) - 1])
    proposal = proposer.propose(tokens, budget, SamplingParams(max_tokens=32), torch.Generator())
    parents = proposal.parent_indices()
    paths = {
        tuple(proposal.tokens[n] for n in path_to(parents, i)) for i in range(len(parents))
    }
    reference = _brute_force(_fresh_log_probs(draft, tokens, hidden), tree, budget)
    assert paths == set(reference)
    scores = dict(zip((tuple(proposal.tokens[n] for n in path_to(parents, i))
                       for i in range(len(parents))), grown[0].scores, strict=True))
    for path, score in reference.items():
        assert math.isclose(scores[path], score, abs_tol=1e-4), path
    assert proposal.probs is None  # deterministic picks: q is one-hot


def test_the_tree_stops_growing_where_a_level_costs_more_than_it_can_add(
    trained: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With measured costs, a level grows only while its frontier's probability mass, in
    one-token target passes, outweighs its draft pass: a target pass made nearly free leaves
    only the first level (no draft pass pays), a dear one lets every level grow. Every level
    is recorded as costing 1 ms, whatever the clock says (a loaded machine once made a draft
    pass dearer than a frontier's mass of 1e3 s target passes)."""
    record = PassCosts.record_tree_level
    monkeypatch.setattr(
        PassCosts, "record_tree_level",
        lambda costs, method, _seconds: record(costs, method, 1e-3),
    )
    target, heads = trained
    model, draft = _target_and_draft(target, heads)
    tokens = load_tokenizer(target).encode("for i in range(10):\n    print(i")
    hidden = features(model, [tokens])[0]
    deepest: dict[tuple[float, int], int] = {}
    for plain_seconds in (1e-9, 1e3):
        costs = PassCosts()
        costs.record_target(1, plain_seconds)
        proposer = EagleProposer(draft, EagleTree(4, 2, 16), costs=costs)
        for attempt in range(2):
            proposer.start(tokens)
            proposer.observe_hidden(hidden[: len(tokens) - 1])
            params = SamplingParams(max_tokens=32)
            proposal = proposer.propose(tokens, 16, params, torch.Generator())
            deepest[plain_seconds, attempt] = max(depths(proposal.parent_indices()))
    # The first level's draft pass is the first measured: then no further level pays.
    assert deepest[1e-9, 0] == 2 and deepest[1e-9, 1] == 1
    assert deepest[1e3, 0] == deepest[1e3, 1] == 4


@pytest.mark.parametrize("k", [None, 3, 10, 16])
def test_greedy_eagle_equals_plain_decoding(
    engine: Engine, k: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    branches: list[bool] = []
    monkeypatch.setattr(speculation, "verify_tree_greedy", side_branch_recorder(branches))
    accepted = greedy_equals_plain(engine, "eagle", k)
    assert accepted > 0, "the draft never got a token accepted: the test proves too little"
    if k is not None and k >= 10:  # adaptive k may stay small; a big tree must branch
        assert any(branches), "no accepted path left the first children: trees went untested"


@pytest.mark.parametrize(
    "tree", [{"num_steps": 1, "eagle_topk": 8}, {"num_steps": 8, "eagle_topk": 1},
             {"num_steps": 3, "eagle_topk": 2, "num_draft_tokens": 5}],
)
def test_greedy_eagle_equals_plain_for_other_tree_shapes(
    trained: tuple[Path, Path], tree: dict[str, int]
) -> None:
    with heads_engine(*trained, "eagle", tree) as eng:
        assert greedy_equals_plain(eng, "eagle", 8) > 0


@pytest.mark.slow
def test_sampled_eagle_is_exact(engine: Engine) -> None:
    assert_sampling_is_exact(engine, "eagle")


def test_vllm_speculative_config_names_eagle(trained: tuple[Path, Path]) -> None:
    _, heads = trained
    spec, model = speculative_config_from_vllm(
        {"method": "eagle", "model": str(heads), "num_speculative_tokens": 4}
    )
    assert (spec.method, spec.num_speculative_tokens, model) == ("eagle", 4, heads)


def test_engine_records_the_eagle_artefact(engine: Engine) -> None:
    assert "eagle" in engine.available_methods
    assert [a["kind"] for a in engine.artefacts] == ["eagle_heads"]


# --- the tree itself: EAGLE-2's expansion against a brute-force one ---------------------

VOCAB = 12


def _log_probs(seed: int, path: tuple[int, ...]) -> torch.Tensor:
    """A fixed random distribution of the token after ``path`` (the draft's stand-in)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + hash(path) % 1_000_000)
    return torch.log_softmax(torch.randn(VOCAB, generator=generator) * 2, dim=-1)


def _brute_force(
    log_probs: Callable[[tuple[int, ...]], torch.Tensor], tree: EagleTree, budget: int
) -> dict[tuple[int, ...], float]:
    """EAGLE-2 over explicit paths: top-k children of the frontier, top-k of them as the next
    frontier, every child a candidate, the best ``budget`` candidates kept."""
    topk, steps = min(tree.eagle_topk, budget), min(tree.num_steps, budget)

    def kids(path: tuple[int, ...], score: float) -> dict[tuple[int, ...], float]:
        best, ids = torch.topk(log_probs(path), topk)
        pairs = zip(best.tolist(), ids.tolist(), strict=True)
        return {(*path, int(t)): score + min(0.0, lp) for lp, t in pairs}

    pool = kids((), 0.0)
    frontier = dict(pool)
    for _ in range(steps - 1):
        level: dict[tuple[int, ...], float] = {}
        for path, score in frontier.items():
            level.update(kids(path, score))
        pool.update(level)
        frontier = dict(sorted(level.items(), key=lambda kv: -kv[1])[:topk])
    return dict(sorted(pool.items(), key=lambda kv: (-kv[1], len(kv[0])))[:budget])


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    steps=st.integers(1, 6),
    topk=st.integers(1, 5),
    draft_tokens=st.integers(1, 16),
    k=st.integers(1, 16),
)
def test_grown_tree_is_valid_and_ranked(
    seed: int, steps: int, topk: int, draft_tokens: int, k: int
) -> None:
    tree = EagleTree(steps, topk, draft_tokens)
    budget = min(k, draft_tokens)

    def expand(frontier: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
        paths = [tuple(tokens[n] for n in path_to(parents, node)) for node in frontier]
        return torch.stack([_log_probs(seed, path) for path in paths])

    grown = grow_tree(_log_probs(seed, ()), expand, tree, budget)
    check_parents(grown.parents)  # every parent comes first
    width, levels = min(topk, budget), min(steps, budget)
    assert len(grown.tokens) == min(budget, width + (levels - 1) * width * width)
    assert max(depths(grown.parents)) <= steps
    assert grown.scores == sorted(grown.scores, reverse=True)
    for siblings in children(grown.parents):
        assert len(siblings) <= topk
        assert len({grown.tokens[i] for i in siblings}) == len(siblings)  # no duplicates
    paths = {
        tuple(grown.tokens[n] for n in path_to(grown.parents, i)): grown.scores[i]
        for i in range(len(grown.tokens))
    }
    for path, score in paths.items():  # a node's score is its path's log-probability
        expected = sum(
            min(0.0, float(_log_probs(seed, path[:d])[path[d]])) for d in range(len(path))
        )
        assert math.isclose(score, expected, abs_tol=1e-5)
    reference = _brute_force(lambda path: _log_probs(seed, path), tree, budget)
    assert set(paths) == set(reference)


def test_no_draft_pass_grows_a_level_the_re_ranking_would_cut() -> None:
    # The root's two best tokens are near-certain and every deeper token has log-probability
    # -5 or less: once the first draft pass has given their children, the 3 best nodes
    # outscore every possible descendant, so the third level (a draft pass) is not run, and
    # the tree is unchanged.
    tree, budget = EagleTree(num_steps=5, eagle_topk=2, num_draft_tokens=3), 3
    sure = torch.full((VOCAB,), -9.0)
    sure[3], sure[7] = -0.01, -0.02
    unsure = torch.full((VOCAB,), -5.0)

    def log_probs(path: tuple[int, ...]) -> torch.Tensor:
        return sure if not path else unsure - 0.1 * len(path)

    calls: list[int] = []

    def expand(frontier: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
        calls.append(len(frontier))
        paths = [tuple(tokens[n] for n in path_to(parents, node)) for node in frontier]
        return torch.stack([log_probs(path) for path in paths])

    grown = grow_tree(log_probs(()), expand, tree, budget)
    assert calls == [2]
    reference = _brute_force(log_probs, tree, budget)
    assert {tuple(grown.tokens[n] for n in path_to(grown.parents, i))
            for i in range(len(grown.tokens))} == set(reference)


def test_heads_cli_trains_eagle_and_serve_settings_pick_it(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    from gateway.settings import engine_config, load_settings

    target, heads = trained
    out = train_heads_with_cli(target, tmp_path, "eagle", "--snippets", "4", "--steps", "2",
                               "--seed", "3")
    summary = json.loads((out / "training.json").read_text())
    assert (summary["method"], summary["target_model_version"]) == (
        "eagle", model_version(target)
    )
    assert heads_method(out) == "eagle"
    # --heads alone: the default method follows the directory's kind.
    assert engine_config(load_settings(target=target, heads=heads)).speculative.method == "eagle"


def test_eagle_method_with_medusa_heads_is_refused_naming_both(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    target, _ = trained
    medusa = tmp_path / "medusa"
    medusa.mkdir()
    (medusa / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "hidden_size": 64}))
    config = EngineConfig(
        target=target, heads=medusa, dtype="float32",
        speculative=SpeculativeConfig(method="eagle"),
    )
    with pytest.raises(HeadsMismatchError, match=r"needs eagle heads.*holds medusa heads"):
        Engine.load(config)


# --- a draft vocabulary (EAGLE-3's d2t/t2d) ----------------------------------------------

SUBSET_SPEC = dataclasses.replace(SPEC, draft_vocab_size=48)


@pytest.fixture(scope="module")
def subset_trained(
    trained: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    target, _ = trained
    model = load_model(target, torch.device("cpu"), "float32")
    version = model_version(target)
    data = build_data(model, load_tokenizer(target), SAMPLE_TEXT, SUBSET_SPEC, version, quiet)
    draft, _ = train_eagle(model, data, SUBSET_SPEC, version, target.name, quiet)
    out = tmp_path_factory.mktemp("eagle-subset") / "heads"
    draft.save(out)
    return target, out


@pytest.fixture(scope="module")
def subset_engine(subset_trained: tuple[Path, Path]) -> Iterator[Engine]:
    with heads_engine(*subset_trained, "eagle") as eng:
        yield eng


def test_a_draft_vocabulary_loads_from_d2t_and_t2d(subset_trained: tuple[Path, Path]) -> None:
    target, heads = subset_trained
    config = json.loads((heads / "config.json").read_text())
    assert config["draft_vocab_size"] == 48
    tensors = load_file(str(heads / "model.safetensors"))
    ids = tensors["d2t"] + torch.arange(48)
    assert tensors["t2d"].nonzero().flatten().tolist() == ids.tolist()
    _, draft = _target_and_draft(target, heads)
    assert draft.head.vocabulary is not None and draft.head.vocabulary.tolist() == ids.tolist()
    # The draft scores the subset only, and names target tokens for its indices.
    assert draft.logits(torch.zeros(64)).shape == (48,)
    assert draft.to_target(torch.tensor([0, 47])).tolist() == [ids[0], ids[47]]


def test_subset_eagle_proposes_inside_it_and_stays_lossless(
    subset_engine: Engine, subset_trained: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = load_file(str(subset_trained[1] / "model.safetensors"))
    subset = set((tensors["d2t"] + torch.arange(48)).tolist())
    proposed = record_proposed_tokens(monkeypatch, EagleProposer)
    accepted = greedy_equals_plain(subset_engine, "eagle", 8)
    assert proposed and set(proposed) <= subset
    assert accepted > 0, "the subset draft never got a token accepted: the test proves too little"


@pytest.mark.slow
def test_sampled_eagle_with_a_draft_vocabulary_is_exact(subset_engine: Engine) -> None:
    """The subset limits what the draft proposes, never what the target can output."""
    assert_sampling_is_exact(subset_engine, "eagle")


def test_features_are_the_lm_head_input_at_every_position(trained: tuple[Path, Path]) -> None:
    """``features`` skips the LM head's pass: it must still be exactly what that head reads."""
    target, _ = trained
    model = load_model(target, torch.device("cpu"), "float32")
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Module)
    tokens = [load_tokenizer(target).encode(text) for text in PROMPTS]
    captured: list[torch.Tensor] = []
    hook = head.register_forward_pre_hook(lambda _m, inputs: captured.append(inputs[0]))
    try:
        with torch.inference_mode():
            for ids in tokens:
                model(input_ids=torch.tensor([ids]))
    finally:
        hook.remove()
    batched = features(model, tokens)
    for row, (ids, alone) in enumerate(zip(tokens, captured, strict=True)):
        torch.testing.assert_close(batched[row, : len(ids)], alone[0], rtol=1e-5, atol=1e-5)


def test_a_seeded_eagle_request_reproduces_whatever_the_measured_tree_costs(
    trained: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seeded request pins its proposals' shape as it pins k: the cost-bounded tree depth
    (which follows timing and the other requests) is off for it, so the same request proposes
    the same trees, and gives the same tokens, whether a tree level is measured free or dear.
    A chain-shaped tree (top-1) makes every level count: a dear level would stop it at one."""
    runs = []
    with heads_engine(*trained, "eagle", {"num_steps": 8, "eagle_topk": 1}) as eng:
        prompt = tuple(eng.tokenizer.encode(PROMPTS[0]))
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
        request = GenerationRequest(prompt, params, SpeculativeChoice("eagle"))
        for level_seconds in (0.0, 1e3):
            with monkeypatch.context() as patch:
                patch.setattr(PassCosts, "tree_level", lambda _costs, _method, s=level_seconds: s)
                proposed = record_proposed_tokens(patch, EagleProposer)
                runs.append((eng.generate(request).token_ids, proposed))
    assert runs[0][1], "nothing was proposed: the test proves too little"
    assert runs[1] == runs[0]
