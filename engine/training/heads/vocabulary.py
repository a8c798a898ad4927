"""The output head that heads draft through: the target's own LM head, over its whole
vocabulary or over a draft vocabulary (the tokens the target writes most often).

The demo target's tied 49,152-row head is a fifth of its parameters, and a draft step runs
it once per head (Medusa) or per tree level (EAGLE): over the whole vocabulary it costs most
of what speculation saves. A draft vocabulary keeps the target's rows for a few thousand
tokens (a copy of those rows, the only extra memory it costs), so a draft step reads a
fraction of the head. Proposals then name only tokens in it; verification needs nothing more
to stay exact, because heads propose deterministically (q one-hot) and the target's own
distribution decides what stands.

On disk it is EAGLE-3's and vLLM ``speculators``' mapping, in the heads' safetensors file:
``d2t`` (``[draft_vocab_size]`` int64, target id = draft id + ``d2t[draft id]``) and ``t2d``
(``[vocab_size]`` bool, whether a target id is in the draft vocabulary), with
``draft_vocab_size`` in the config.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

DRAFT_TO_TARGET = "d2t"
TARGET_TO_DRAFT = "t2d"
# Labels outside the draft vocabulary (cross_entropy's ignore_index).
OUTSIDE = -100


class DraftHead(nn.Module):
    """Logits over the draft vocabulary from features ``[..., hidden]``; ``to_target`` maps
    draft indices to the target's token ids. ``vocabulary`` None: the target's whole head,
    shared, not copied."""

    def __init__(self, lm_head: nn.Module, vocabulary: torch.Tensor | None = None) -> None:
        super().__init__()
        self._shared = [lm_head]  # not a submodule: the target's, outside state_dict
        self.vocabulary: torch.Tensor | None
        self.weight: torch.Tensor | None
        self.bias: torch.Tensor | None
        if vocabulary is None:
            self.register_buffer("vocabulary", None, persistent=False)
            self.register_buffer("weight", None, persistent=False)
            self.register_buffer("bias", None, persistent=False)
            return
        if not isinstance(lm_head, nn.Linear):
            raise ValueError("a draft vocabulary needs a linear output head")
        rows = vocabulary.to(device=lm_head.weight.device, dtype=torch.long)
        bias = None if lm_head.bias is None else lm_head.bias.detach()[rows].clone()
        self.register_buffer("vocabulary", rows, persistent=False)
        self.register_buffer("weight", lm_head.weight.detach()[rows].clone(), persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @property
    def size(self) -> int:
        if self.vocabulary is not None:
            return int(self.vocabulary.numel())
        weight = getattr(self._shared[0], "weight", None)
        assert isinstance(weight, torch.Tensor)
        return int(weight.shape[0])

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            result: torch.Tensor = self._shared[0](features)
            return result
        return F.linear(features.to(self.weight.dtype), self.weight, self.bias)

    def to_target(self, indices: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary indices."""
        return indices if self.vocabulary is None else self.vocabulary[indices]

    def to_draft(self, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft indices of target token ids, ``OUTSIDE`` for those not in the vocabulary."""
        if self.vocabulary is None:
            return token_ids
        index = torch.full((vocab_size,), OUTSIDE, dtype=torch.long, device=token_ids.device)
        index[self.vocabulary] = torch.arange(self.size, device=token_ids.device)
        return index[token_ids]

    def tensors(self, vocab_size: int) -> dict[str, torch.Tensor]:
        """``d2t`` and ``t2d`` for the heads' safetensors file (none for the whole head)."""
        if self.vocabulary is None:
            return {}
        ids = self.vocabulary.cpu()
        inside = torch.zeros(vocab_size, dtype=torch.bool)
        inside[ids] = True
        return {DRAFT_TO_TARGET: ids - torch.arange(len(ids)), TARGET_TO_DRAFT: inside}


def vocabulary_from_tensors(
    tensors: dict[str, torch.Tensor], vocab_size: int, where: str
) -> torch.Tensor | None:
    """The draft vocabulary (sorted target ids) a heads file's ``d2t``/``t2d`` describe, or
    None when it has none; inconsistent or out-of-range mappings are refused."""
    if DRAFT_TO_TARGET not in tensors:
        return None
    offsets = tensors[DRAFT_TO_TARGET].long()
    ids = offsets + torch.arange(len(offsets))
    if len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{where}: d2t maps outside the target's {vocab_size} tokens")
    if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{where}: d2t must map to distinct target ids in increasing order")
    inside = tensors.get(TARGET_TO_DRAFT)
    if inside is not None:
        expected = torch.zeros(vocab_size, dtype=torch.bool)
        expected[ids] = True
        if inside.shape != expected.shape or not bool((inside.bool() == expected).all()):
            raise ValueError(f"{where}: t2d does not match d2t")
    return ids


def frequent_tokens(
    sequences: Iterable[Iterable[int]], size: int, always: Iterable[int], vocab_size: int
) -> torch.Tensor:
    """The ``size`` tokens written most often in ``sequences`` (ties by id) and ``always``,
    sorted by id; too few distinct tokens are filled up with the lowest ids."""
    counts = Counter(t for sequence in sequences for t in sequence)
    chosen = {t for t in always if 0 <= t < vocab_size}
    for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(chosen) >= size:
            break
        chosen.add(token)
    filler = iter(range(vocab_size))
    while len(chosen) < min(size, vocab_size):
        chosen.add(next(filler))
    return torch.tensor(sorted(chosen), dtype=torch.long)


def extra_bytes(module: nn.Module) -> int:
    """Memory a module holds of its own: its parameters and buffers (a draft vocabulary's
    copied rows included; the target's shared head and embedding are not its own)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
