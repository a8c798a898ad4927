"""The runner for a model whose cache slots cannot share a pass (sliding-window, chunked or
recurrent layers): each slot is its own ``ModelRunner`` (Hugging Face's cache, which rolls those
layers back correctly), and a pass runs its feeds one after another, behind
``BatchedRunner``'s interface. The target of such a model runs the same scheduler and step
(``engine.serving.step``) on one slot; a draft model of such an architecture drafts for every
sequence of a step through the same pool as a batching one
(``engine.speculation.proposers.draft``), a slot per sequence.
"""

from __future__ import annotations

import torch

from engine.models.batched_runner import Feed
from engine.models.model_runner import ModelRunner
from engine.speculation.tree import ancestor_mask, depths


class SerialRunner:
    """Slot i over ``runners[i]``'s cache; every runner runs the same model."""

    def __init__(self, *runners: ModelRunner) -> None:
        self.runners = runners
        self.model = runners[0].model
        self.device = runners[0].device
        self.max_slots = len(runners)

    def forward(self, feeds: list[Feed], last_only: bool = False) -> list[torch.Tensor]:
        """Each feed's logits, as ``BatchedRunner.forward``'s (with ``last_only``, each
        feed's last row)."""
        logits = []
        for feed in feeds:
            positions, mask = self._tree(feed)
            runner = self.runners[feed.slot]
            logits.append(
                runner.forward(feed.tokens, last_only, positions=positions, tree_mask=mask)
            )
        return logits

    def fill(self, feeds: list[Feed]) -> None:
        """Store every feed's rows in its slot's cache (the last row's logits, which a pass
        of Hugging Face's model computes anyway, are dropped)."""
        for feed in feeds:
            self.runners[feed.slot].forward(feed.tokens, last_only=True)

    def forward_hidden(self, feeds: list[Feed]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        logits, hidden = [], []
        for feed in feeds:
            positions, mask = self._tree(feed)
            rows, states = self.runners[feed.slot].forward_hidden(
                feed.tokens, positions=positions, tree_mask=mask
            )
            logits.append(rows)
            hidden.append(states)
        return logits, hidden

    def _tree(self, feed: Feed) -> tuple[list[int] | None, torch.Tensor | None]:
        """A tree's positions (its depths behind the cached prefix) and ancestor mask; a
        chain takes the causal defaults (None, None)."""
        if feed.parents is None:
            return None, None
        fed_depths = (0, *depths(feed.parents))
        length = self.runners[feed.slot].length
        positions = [length + depth for depth in fed_depths]
        return positions, ancestor_mask(feed.parents)

    def keep_path(self, slot: int, committed_len: int, path: tuple[int, ...] | list[int]) -> None:
        self.runners[slot].keep_path(committed_len, path)

    def truncate(self, slot: int, length: int) -> None:
        self.runners[slot].truncate(length)

    def move_slot(self, source: int, target: int) -> None:
        """Nothing ever moves: a target runs one slot, and a draft pool's slots stay with
        their requests."""
        raise ValueError("a serial runner's slots do not move")

    def release(self, slot: int) -> None:
        self.runners[slot].reset()

    def reserve(self, slot: int, positions: int) -> None:
        """Nothing to reserve: Hugging Face's cache grows as the sequence does."""
