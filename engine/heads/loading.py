"""Heads loaded over a loaded target: its own LM head (and, for EAGLE, its embedding) shared,
moved to its device and dtype; heads for another version of it are refused."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from engine.heads import heads_method
from engine.heads.eagle import EagleDraft, load_eagle
from engine.heads.medusa import MedusaHeads, load_heads
from engine.loading import embedding_rows


def medusa_for(directory: Path, target: PreTrainedModel, target_version: str) -> MedusaHeads:
    head = target.get_output_embeddings()
    assert isinstance(head, torch.nn.Module)
    heads = load_heads(
        directory, head, int(target.config.hidden_size), embedding_rows(target), target_version
    )
    return heads.to(device=target.device, dtype=target.dtype)


def eagle_for(directory: Path, target: PreTrainedModel, target_version: str) -> EagleDraft:
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    assert isinstance(embed, torch.nn.Module) and isinstance(head, torch.nn.Module)
    draft = load_eagle(
        directory, embed, head, int(target.config.hidden_size), embedding_rows(target),
        target_version,
    )
    return draft.to(device=target.device, dtype=target.dtype)


def load_heads_for(
    directory: Path, target: PreTrainedModel, target_version: str
) -> tuple[str, MedusaHeads | EagleDraft]:
    """The method a heads directory serves and its heads over ``target``."""
    if heads_method(directory) == "eagle":
        return "eagle", eagle_for(directory, target, target_version)
    return "medusa", medusa_for(directory, target, target_version)
