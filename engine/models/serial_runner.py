"""The step's runner for a model whose cache slots cannot share a pass (sliding-window,
chunked or recurrent layers): one sequence at a time, in Hugging Face's own cache
(``ModelRunner``), behind ``BatchedRunner``'s interface, so that every request of every
model runs the same scheduler and the same step (``engine.serving.step``).
"""

from __future__ import annotations

import torch

from engine.models.batched_runner import Feed
from engine.models.model_runner import ModelRunner
from engine.speculation.tree import ancestor_mask, depths


class SerialRunner:
    """One slot (slot 0) over ``runner``'s cache."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.device = runner.device

    def forward(self, feeds: list[Feed], last_only: bool = False) -> list[torch.Tensor]:
        (feed,) = feeds
        positions, mask = self._tree(feed)
        return [self.runner.forward(feed.tokens, last_only, positions=positions, tree_mask=mask)]

    def forward_hidden(self, feeds: list[Feed]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        (feed,) = feeds
        positions, mask = self._tree(feed)
        logits, hidden = self.runner.forward_hidden(
            feed.tokens, positions=positions, tree_mask=mask
        )
        return [logits], [hidden]

    def _tree(self, feed: Feed) -> tuple[list[int] | None, torch.Tensor | None]:
        """A tree's positions (its depths behind the cached prefix) and ancestor mask; a
        chain takes the causal defaults (None, None)."""
        if feed.parents is None:
            return None, None
        fed_depths = (0, *depths(feed.parents))
        positions = [self.runner.length + depth for depth in fed_depths]
        return positions, ancestor_mask(feed.parents)

    def keep_path(self, slot: int, committed_len: int, path: tuple[int, ...] | list[int]) -> None:
        self.runner.keep_path(committed_len, path)

    def truncate(self, slot: int, length: int) -> None:
        self.runner.truncate(length)

    def move_slot(self, source: int, target: int) -> None:
        raise ValueError("a serial runner has one slot; there is nothing to move")

    def release(self, slot: int) -> None:
        self.runner.reset()

    def reserve(self, slot: int, positions: int) -> None:
        """Nothing to reserve: Hugging Face's cache grows as the sequence does."""
