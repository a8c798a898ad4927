"""Heads whose draft vocabulary is narrower than the tree they grow: Medusa's default tree
ranks up to the tenth token at a node and EAGLE expands its top 8, so heads scoring two tokens
once asked ``topk`` for more rows than they have (a 500 through the gateway). Nodes beyond what
the heads score are left out; greedy speculation stays plain decoding."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.models.loading import load_model
from engine.models.versioning import model_version
from engine.training.heads.eagle import EagleConfig, EagleDraft
from engine.training.heads.medusa import MedusaConfig, MedusaHeads
from tests.heads_harness import greedy_equals_plain, heads_engine
from tests.tiny_models import build_pair

SCORED = 2  # tokens the heads score


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_pair(tmp_path_factory.mktemp("narrow"))[0]


def _lm_head(target: Path) -> tuple[torch.nn.Module, torch.nn.Linear]:
    model = load_model(target, torch.device("cpu"), "float32")
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Linear)
    return model, head


def test_medusa_heads_scoring_fewer_tokens_than_the_tree_is_wide(
    target: Path, tmp_path: Path
) -> None:
    _, head = _lm_head(target)
    torch.manual_seed(0)
    config = MedusaConfig(
        medusa_num_heads=3, medusa_num_layers=1, hidden_size=int(head.weight.shape[1]),
        vocab_size=int(head.weight.shape[0]), target_model_version=model_version(target),
        draft_vocab_size=SCORED,
    )  # fmt: skip
    MedusaHeads(config, head, vocabulary=torch.arange(SCORED)).save(tmp_path / "medusa")
    with heads_engine(target, tmp_path / "medusa", "medusa") as engine:
        for k in (None, 8):
            greedy_equals_plain(engine, "medusa", k)


def test_eagle_heads_scoring_fewer_tokens_than_its_top_k(target: Path, tmp_path: Path) -> None:
    model, head = _lm_head(target)
    torch.manual_seed(0)
    config = dataclasses.replace(
        EagleConfig.for_target(
            model.config, int(head.weight.shape[0]), "target", model_version(target)
        ),
        draft_vocab_size=SCORED,
    )
    embed = model.get_input_embeddings()
    EagleDraft(config, embed, head, vocabulary=torch.arange(SCORED)).save(tmp_path / "eagle")
    with heads_engine(target, tmp_path / "eagle", "eagle") as engine:
        for k in (None, 8):
            greedy_equals_plain(engine, "eagle", k)
