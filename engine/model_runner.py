"""One causal LM with its own KV cache, for batch size one.

The cache always holds the keys and values of a prefix of the sequence; ``truncate`` is the
exact rollback after a rejected proposal (the rejected positions are simply dropped). For
models with recurrent layers (linear attention), whose state cannot be cropped, the runner
keeps a snapshot of that state before each pass since the last rollback; rolling back
restores the snapshot of the pass that crossed the new length and feeds the accepted part
of that pass again (one extra pass over the accepted tokens).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from engine.kv_cache import (
    RecurrentStates,
    has_recurrent_state,
    new_cache,
    restore_recurrent_states,
    save_recurrent_states,
)


class ModelRunner:
    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = model.device
        self.cache = new_cache(model.config)
        self.recurrent = has_recurrent_state(self.cache)
        # Counted here: a cache of recurrent layers only (Mamba) has no sequence length.
        self._length = 0
        # Passes since the last rollback, with recurrent layers: (start, tokens, states before).
        self._passes: list[tuple[int, list[int], RecurrentStates]] = []

    @property
    def length(self) -> int:
        """Number of positions whose keys and values (or recurrent state) are cached."""
        return self._length

    def reset(self) -> None:
        self.cache = new_cache(self.model.config)
        self._length = 0
        self._passes.clear()

    @torch.inference_mode()
    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions. Always crops, also by nothing: that shrinks the
        past that sliding-window and convolution layers recorded since the last call."""
        excess = self.length - length
        if excess < 0:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        passes, self._passes = self._passes, []
        if self.length == 0:
            return  # nothing cached (transformers' layers cannot crop before their first pass)
        if not (self.recurrent and excess):
            self.cache.crop(-excess)
            self._length = length
            return
        crossing = [p for p in passes if p[0] <= length]
        if not crossing:
            raise ValueError(f"no pass since the last rollback starts at or before {length}")
        start, tokens, states = crossing[-1]
        if start == 0:
            self.cache = new_cache(self.model.config)
        else:
            self.cache.crop(-(self.length - start))
            restore_recurrent_states(self.cache, states)
        self._length = start
        if length > start:
            self._run(tokens[: length - start], last_only=True)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], last_only: bool = False) -> torch.Tensor:
        """Run ``token_ids`` after the cached prefix; returns float32 logits ``[len, vocab]``,
        or ``[1, vocab]`` for the last position only (prefill and drafting need no more, and a
        long prompt's full logits would cost gigabytes)."""
        if self.recurrent:
            self._passes.append((self.length, list(token_ids), save_recurrent_states(self.cache)))
        return self._run(token_ids, last_only)

    def _run(self, token_ids: list[int], last_only: bool) -> torch.Tensor:
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0
        )
        self._length += len(token_ids)
        return out.logits[0].float()
