"""One causal LM with its own KV cache, for batch size one.

The cache always holds the keys and values of a prefix of the sequence; ``truncate`` is the
exact rollback after a rejected proposal (the rejected positions are simply dropped).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from engine.kv_cache import new_cache


class ModelRunner:
    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = model.device
        self.cache = new_cache(model.config)

    @property
    def length(self) -> int:
        """Number of positions whose keys and values are cached."""
        return self.cache.get_seq_length()

    def reset(self) -> None:
        self.cache = new_cache(self.model.config)

    def truncate(self, length: int) -> None:
        excess = self.length - length
        if excess < 0:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        if excess:
            self.cache.crop(-excess)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], last_only: bool = False) -> torch.Tensor:
        """Run ``token_ids`` after the cached prefix; returns float32 logits ``[len, vocab]``,
        or ``[1, vocab]`` for the last position only (prefill and drafting need no more, and a
        long prompt's full logits would cost gigabytes)."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0
        )
        return out.logits[0].float()
