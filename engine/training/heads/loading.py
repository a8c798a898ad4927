"""Heads loaded over a loaded target: its own LM head (and, for EAGLE, its embedding) shared,
moved to its device and dtype; heads for another version of it are refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

import torch
from transformers import PreTrainedModel

from engine.models.loading import embedding_rows
from engine.models.versioning import model_version
from engine.speculation.methods import Artefact, LoadContext, LoadedMethod, MethodSpec
from engine.training.heads import check_heads_kind, heads_method
from engine.training.heads.eagle import EagleDraft, load_eagle
from engine.training.heads.medusa import MedusaHeads, load_heads

if TYPE_CHECKING:
    from engine.speculation.proposers.base import Proposer

Heads = TypeVar("Heads", MedusaHeads, EagleDraft)


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


def load_heads_method(
    context: LoadContext,
    spec: MethodSpec,
    method: Literal["medusa", "eagle"],
    heads_for: Callable[[Path, PreTrainedModel, str], Heads],
    proposer: Callable[[Heads, bool], Proposer],
) -> LoadedMethod:
    """A heads method ready to serve: the heads in ``spec``'s artefact directory over the
    loaded target (refused when they are the other method's or were trained for another
    target), a factory of ``proposer(heads, trees_allowed)`` (``trees_allowed`` False where
    the target's runner verifies chains only), and the heads as a versioned artefact for the
    audit log."""
    directory = context.artefact_dir(spec)
    assert directory is not None and spec.artefact is not None  # EngineConfig refuses it
    check_heads_kind(method, directory)
    heads = heads_for(directory, context.target, context.target_version)
    trees_allowed = context.target_runner.supports_trees
    return LoadedMethod(
        lambda: proposer(heads, trees_allowed),
        (Artefact(spec.artefact.kind, directory.name, model_version(directory)),),
    )
