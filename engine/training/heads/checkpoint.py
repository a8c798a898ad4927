"""A heads checkpoint read for a loaded target: what the Medusa and the EAGLE loader share.

Both keep ``config.json`` beside ``model.safetensors``; both refuse heads trained on another
version of the target, or for another hidden size or vocabulary, naming both sides (their
guesses would be for a model that is not running); and both keep a draft vocabulary's
``d2t``/``t2d`` (``engine.training.heads.vocabulary``) apart from the weights of their own modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch
from safetensors.torch import load_file

from engine.training.heads import HeadsMismatchError
from engine.training.heads.vocabulary import (
    DRAFT_TO_TARGET,
    TARGET_TO_DRAFT,
    vocabulary_from_tensors,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

_NAMES = {"medusa": "Medusa", "eagle": "EAGLE"}


class TrainedFor(Protocol):
    """What a heads config says of the target it was trained for."""

    @property
    def target_model_version(self) -> str | None: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True)
class Target:
    """What heads must match of the loaded target."""

    version: str
    hidden_size: int
    vocab_size: int


@dataclass(frozen=True)
class Checkpoint:
    weights: dict[str, torch.Tensor]  # the heads' own tensors (no d2t/t2d)
    vocabulary: torch.Tensor | None  # the draft vocabulary's target ids; None: all of them


def check_fit(
    method: Literal["medusa", "eagle"], heads_dir: Path, config: TrainedFor, target: Target
) -> None:
    """Refuse heads trained on another version of ``target`` (a config without a version
    is trusted: heads trained elsewhere) or for another hidden size and vocabulary."""
    name = f"{_NAMES[method]} heads in {heads_dir}"
    trained_on = config.target_model_version
    if trained_on is not None and trained_on != target.version:
        raise HeadsMismatchError(
            f"{name} were trained on target version {trained_on}, but the target loaded is "
            f"version {target.version}; train heads for this target "
            f"(specgate heads train --method {method})"
        )
    if (config.hidden_size, config.vocab_size) != (target.hidden_size, target.vocab_size):
        raise HeadsMismatchError(
            f"{name} are for hidden size {config.hidden_size} and vocabulary "
            f"{config.vocab_size}; the target has {target.hidden_size} and {target.vocab_size}"
        )


def read_checkpoint(
    method: Literal["medusa", "eagle"], heads_dir: Path, config: TrainedFor, target: Target
) -> Checkpoint:
    """The weights and draft vocabulary of heads that fit ``target`` (``check_fit``); an
    inconsistent ``d2t``/``t2d`` is refused too."""
    check_fit(method, heads_dir, config, target)
    stored = load_file(str(heads_dir / WEIGHTS_FILE))
    try:
        vocabulary = vocabulary_from_tensors(stored, target.vocab_size, str(heads_dir))
    except ValueError as error:
        raise HeadsMismatchError(str(error)) from error
    mapping = (DRAFT_TO_TARGET, TARGET_TO_DRAFT)
    return Checkpoint({k: t for k, t in stored.items() if k not in mapping}, vocabulary)
