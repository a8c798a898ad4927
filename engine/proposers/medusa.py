"""Medusa: a static tree of the heads' top-k candidates, drafted from the target's last
hidden state in one small computation per step (no draft model pass).

The tree is a list of paths of top-k ranks: ``(0,)`` is head 0's best token, ``(0, 1)``
head 1's second best under it, and so on; every path's parent comes before it, so the first
k paths are always a tree (adaptive k trims the tree from its end). The picks are
deterministic, so the proposal's q is one-hot (``probs`` None), which is what keeps tree
verification exact for sampled requests too.
"""

from __future__ import annotations

import torch

from engine.heads.medusa import MedusaHeads
from engine.logits_processors import LogitsProcessing
from engine.proposers.base import Proposal
from engine.types import Method, SamplingParams

# Ordered roughly by how often such a node is accepted (head 0's top ranks first).
DEFAULT_MEDUSA_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (0, 0), (2,), (0, 1), (1, 0), (0, 0, 0), (3,), (0, 2), (0, 0, 1),
    (2, 0), (1, 1), (0, 0, 0, 0), (0, 1, 0), (4,), (0, 0, 0, 1),
)


def check_tree(paths: tuple[tuple[int, ...], ...]) -> None:
    seen: set[tuple[int, ...]] = set()
    for path in paths:
        if not path or min(path) < 0:
            raise ValueError(f"tree path {path} must be a non-empty tuple of ranks")
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"tree path {path} comes before its parent {path[:-1]}")
        if path in seen:
            raise ValueError(f"tree path {path} is listed twice")
        seen.add(path)


class MedusaProposer:
    method: Method = "medusa"
    wants_hidden = True

    def __init__(
        self,
        heads: MedusaHeads,
        tree: tuple[tuple[int, ...], ...] = DEFAULT_MEDUSA_TREE,
        trees_allowed: bool = True,
    ) -> None:
        """``trees_allowed`` False (a target that verifies chains only): the tree shrinks to
        its chain of top-1 picks."""
        check_tree(tree)
        depth = heads.config.medusa_num_heads
        paths = [p for p in tree if len(p) <= depth]
        if not trees_allowed:
            paths = [p for p in paths if all(rank == 0 for rank in p)]
        self.heads = heads
        self.paths = tuple(paths)
        self._hidden: torch.Tensor | None = None

    def start(self, prompt_ids: list[int]) -> None:
        self._hidden = None

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        self._hidden = hidden[-1]

    @torch.inference_mode()
    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        min_confidence: float = 0.0,
        processing: LogitsProcessing | None = None,
    ) -> Proposal:
        """The static tree's first ``k`` nodes, from the heads' top-k. Deterministic (q is
        one-hot), so ``processing`` need not shape it: the target's processed distribution
        alone decides what stands."""
        if self._hidden is None or k < 1:
            return Proposal([])
        paths = self.paths[:k]
        depth = max(len(p) for p in paths)
        ranks = [1 + max(p[d] for p in paths if len(p) > d) for d in range(depth)]
        weight = next(self.heads.parameters())
        hidden = self._hidden.to(weight.dtype)
        top = [
            torch.topk(self.heads.logits(hidden, d).float(), ranks[d]).indices.tolist()
            for d in range(depth)
        ]
        index = {path: i for i, path in enumerate(paths)}
        tokens = [top[len(p) - 1][p[-1]] for p in paths]
        parents = tuple(-1 if len(p) == 1 else index[p[:-1]] for p in paths)
        return Proposal(tokens, parents=parents)

    def accepted(self, context: list[int]) -> None:
        return None
