"""A draft whose output head covers a subset of the vocabulary.

A draft directory may hold ``draft_vocabulary.json``: the sorted token ids its head keeps.
The proposer then computes logits for those rows only, which makes a small draft's pass much
cheaper when the vocabulary is large, and proposes only tokens from the subset: its q is 0
everywhere else. Verification needs nothing more to stay exact, since rejection sampling is
correct for any q, and greedy verification only compares tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PreTrainedModel

VOCABULARY_FILE = "draft_vocabulary.json"


def load_head_vocabulary(model_dir: Path, vocab_size: int) -> torch.Tensor | None:
    """The subset's token ids, or None when the draft's head is the whole vocabulary."""
    path = model_dir / VOCABULARY_FILE
    if not path.is_file():
        return None
    ids = json.loads(path.read_text())
    if (
        not isinstance(ids, list)
        or not ids
        or any(not isinstance(i, int) or not 0 <= i < vocab_size for i in ids)
        or ids != sorted(set(ids))
    ):
        raise ValueError(f"{path}: expected sorted distinct token ids in [0, {vocab_size})")
    return torch.tensor(ids, dtype=torch.long)


def restrict_head(model: PreTrainedModel, vocabulary: torch.Tensor) -> None:
    """Replace the output head by one over ``vocabulary``'s rows (untied from the embeddings)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError("a vocabulary subset needs a linear output head")
    rows = vocabulary.to(head.weight.device)
    restricted = torch.nn.Linear(
        head.in_features, len(vocabulary), bias=head.bias is not None,
        device=head.weight.device, dtype=head.weight.dtype,
    )
    with torch.no_grad():
        restricted.weight.copy_(head.weight[rows])
        if head.bias is not None:
            restricted.bias.copy_(head.bias[rows])
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(restricted)
