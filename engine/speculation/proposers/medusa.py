"""Medusa: a static tree of the heads' top-k candidates, drafted from the target's last
hidden state in one small computation per step (no draft model pass).

The tree is a list of paths of top-k ranks: ``(0,)`` is head 0's best token, ``(0, 1)``
head 1's second best under it, and so on; every path's parent comes before it, so the first
k paths are always a tree (adaptive k trims the tree from its end). The picks are
deterministic, so the proposal's q is one-hot (``probs`` None), which is what keeps tree
verification exact for sampled requests too.

Registered as the method ``medusa`` (vLLM's name too). It loads the heads in
``EngineConfig.heads`` (a ``medusa_heads`` artefact in the audit log) and adds one key to the
speculative configuration, ``medusa_tree`` (``MedusaOptions``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.api.types import Method, SamplingParams
from engine.speculation.logits_processors import LogitsProcessing
from engine.speculation.methods import ArtefactSpec, LoadContext, LoadedMethod, MethodSpec, register
from engine.speculation.proposers.base import Proposal
from engine.training.heads import HeadsMismatchError
from engine.training.heads.loading import load_heads_method, medusa_for
from engine.training.heads.medusa import MedusaHeads, read_config

# Ordered roughly by how often such a node is accepted (head 0's top ranks first): the first
# 16 nodes are within 1 % of the best 16-node tree that measured per-rank head accuracies
# choose, the next 16 ``sparse_tree``'s extension of it to 32 nodes under those accuracies
# (bench/results/2026-12-06-engine-speculation.md, "Medusa trees above 16 nodes"); adaptive k
# takes a prefix, so any k gets a good tree of k nodes.
DEFAULT_MEDUSA_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (0, 0), (2,), (0, 1), (1, 0), (0, 0, 0), (3,), (0, 2), (0, 0, 1),
    (2, 0), (1, 1), (0, 0, 0, 0), (0, 1, 0), (4,), (0, 0, 0, 1),
    (5,), (0, 3), (3, 0), (0, 4), (1, 0, 0), (4, 0), (0, 5), (5, 0), (0, 0, 2), (0, 2, 0),
    (2, 0, 0), (0, 0, 3), (0, 3, 0), (3, 0, 0), (1, 2), (2, 1),
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


def sparse_tree(
    rank_accuracy: Sequence[Sequence[float]],
    nodes: int,
    start: Sequence[tuple[int, ...]] = (),
) -> tuple[tuple[int, ...], ...]:
    """Medusa's sparse tree: ``start`` (a tree, kept as it is), then the paths of ranks with
    the highest expected acceptance until there are ``nodes``, best first, where a path's is
    the product of its ranks' accuracies (``rank_accuracy[d][r]``: head d's rank r,
    ``engine.training.heads.train.medusa_rank_accuracy``), the heads taken as independent. A path is
    worth at most its parent, so the paths come after their parents, and from ``start`` on
    every prefix of the list is the best tree of its size that holds ``start``."""
    chosen = list(start)
    frontier: list[tuple[float, tuple[int, ...]]] = []
    for parent in [(), *chosen]:
        if len(parent) < len(rank_accuracy):
            value = math.prod(rank_accuracy[d][r] for d, r in enumerate(parent))
            for r, accuracy in enumerate(rank_accuracy[len(parent)]):
                if (*parent, r) not in chosen:
                    frontier.append((-value * accuracy, (*parent, r)))
    heapq.heapify(frontier)
    while frontier and len(chosen) < nodes:
        value, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < len(rank_accuracy):
            for r, accuracy in enumerate(rank_accuracy[len(path)]):
                heapq.heappush(frontier, (value * accuracy, (*path, r)))
    return tuple(chosen)


def tree_expected_tokens(
    rank_accuracy: Sequence[Sequence[float]], paths: Sequence[tuple[int, ...]]
) -> float:
    """Tokens a step with the tree ``paths`` commits on average under ``sparse_tree``'s
    model: the one the target always adds, and each node's chance of being accepted."""
    return 1.0 + sum(math.prod(rank_accuracy[d][r] for d, r in enumerate(p)) for p in paths)


class MedusaProposer:
    method: Method = "medusa"
    wants_hidden = True
    proposes_trees = True

    def __init__(
        self,
        heads: MedusaHeads,
        tree: tuple[tuple[int, ...], ...] = DEFAULT_MEDUSA_TREE,
        trees_allowed: bool = True,
    ) -> None:
        """``trees_allowed`` False (a target that verifies chains only): the tree shrinks to
        its chain of top-1 picks. Nodes ranked beyond what the heads score (a draft vocabulary
        smaller than the tree is wide) are left out, with everything under them."""
        check_tree(tree)
        depth = heads.config.medusa_num_heads
        scored = heads.config.draft_vocab_size or heads.config.vocab_size
        paths = [p for p in tree if len(p) <= depth and max(p) < scored]
        if not trees_allowed:
            paths = [p for p in paths if all(rank == 0 for rank in p)]
        self.heads = heads
        self.paths = tuple(paths)
        self.most_tokens: int | None = len(self.paths)
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
        logits = self.heads.all_logits(hidden, depth)
        top = [
            self.heads.to_target(torch.topk(logits[d], ranks[d]).indices).tolist()
            for d in range(depth)
        ]
        index = {path: i for i, path in enumerate(paths)}
        tokens = [top[len(p) - 1][p[-1]] for p in paths]
        parents = tuple(-1 if len(p) == 1 else index[p[:-1]] for p in paths)
        return Proposal(tokens, parents=parents)

    def accepted(self, context: list[int]) -> None:
        return None


class MedusaOptions(BaseModel):
    """Medusa's key in the speculative configuration."""

    model_config = ConfigDict(extra="forbid")

    medusa_tree: list[list[int]] | None = Field(
        default=None,
        description="Medusa's static tree as paths of top-k ranks, e.g. [[0], [1], [0, 0]] "
        "(each after its parent); None: the built-in tree (engine.speculation.proposers.medusa).",
    )

    @field_validator("medusa_tree")
    @classmethod
    def _a_tree(cls, tree: list[list[int]] | None) -> list[list[int]] | None:
        if tree is not None:
            check_tree(tuple(tuple(path) for path in tree))
        return tree

    def tree(self) -> tuple[tuple[int, ...], ...]:
        if self.medusa_tree is None:
            return DEFAULT_MEDUSA_TREE
        return tuple(tuple(path) for path in self.medusa_tree)


def _load(context: LoadContext) -> LoadedMethod:
    """The heads in ``config.heads``, proposing the configured tree; heads trained on
    another version of the target are refused (``engine.training.heads.medusa.load_heads``)."""
    options = context.config.speculative.options_for("medusa")
    assert isinstance(options, MedusaOptions)
    tree = options.tree()
    return load_heads_method(
        context, MEDUSA, "medusa", medusa_for,
        lambda heads, trees_allowed: MedusaProposer(heads, tree, trees_allowed),
    )


def _holds_medusa_heads(directory: Path) -> bool:
    try:
        read_config(directory)
    except (OSError, ValueError, KeyError, HeadsMismatchError):
        return False
    return True


MEDUSA = register(
    MethodSpec(
        name="medusa",
        vllm_names=("medusa",),
        options=MedusaOptions,
        artefact=ArtefactSpec("medusa_heads", "heads", "heads"),
        recognises=_holds_medusa_heads,
        load=_load,
    )
)
