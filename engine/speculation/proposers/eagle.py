"""EAGLE-2: a draft tree grown where the EAGLE draft is most confident.

Each node's score is the draft's cumulative log-probability of its path. The tree grows
``num_steps`` levels deep: the root's ``eagle_topk`` best tokens form the first frontier;
each level feeds the frontier through the draft (in one pass, with a tree mask), gives every
frontier node its ``eagle_topk`` best children, and keeps the ``eagle_topk`` best-scoring of
those children as the next frontier. Every node generated is a candidate; the
``num_draft_tokens`` (or ``k``, if smaller) best-scoring candidates are proposed, in score
order. A child's score never exceeds its parent's (log-probabilities are at most 0), and ties
go to the shallower node, so a kept node's parent is always kept and comes first: the kept
set is a valid tree in topological order. (These are SGLang's ``speculative_num_steps``,
``speculative_eagle_topk`` and ``speculative_num_draft_tokens``.)

The picks are deterministic, so the proposal's q is one-hot (``probs`` None), which keeps
sampled verification exact; the target's processed distribution alone decides what stands.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from engine.api.types import MAX_SPECULATIVE_TOKENS, Method, SamplingParams
from engine.speculation.adaptive import PassCosts
from engine.speculation.logits_processors import LogitsProcessing
from engine.speculation.methods import ArtefactSpec, LoadContext, LoadedMethod, MethodSpec, register
from engine.speculation.proposers.base import Proposal
from engine.training.heads import heads_method
from engine.training.heads.eagle import EagleCache, EagleDraft
from engine.training.heads.loading import eagle_for, load_heads_method

# Given the frontier's node ids and the tree so far (tokens, parents), the log-probabilities
# ``[len(frontier), draft vocabulary]`` of each frontier node's children.
Expand = Callable[[list[int], list[int], list[int]], torch.Tensor]
# Target token ids of draft-vocabulary indices (the identity without a draft vocabulary).
ToTarget = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class EagleTree:
    num_steps: int = 5
    # SGLang's default top-k is 4; 8 gave longer accepted runs on the demo target's heads
    # (bench/results/2026-12-06-engine-speculation.md).
    eagle_topk: int = 8
    num_draft_tokens: int = 16

    def __post_init__(self) -> None:
        if min(self.num_steps, self.eagle_topk, self.num_draft_tokens) < 1:
            raise ValueError("num_steps, eagle_topk and num_draft_tokens must be at least 1")


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]
    parents: tuple[int, ...]
    scores: list[float]  # cumulative draft log-probability of each node's path


def grow_tree(
    root: torch.Tensor,
    expand: Expand,
    tree: EagleTree,
    budget: int,
    to_target: ToTarget | None = None,
    pays: Callable[[float], bool] | None = None,
) -> DraftTree:
    """The best ``budget`` nodes of the tree grown from the root's log-probabilities
    ``root`` ``[draft vocabulary]``; ``expand`` scores the children of a frontier and
    ``to_target`` names the target tokens of their indices. ``pays``, given the frontier's
    draft probability mass (what its children can add to the expected accepted length, at
    most), says whether another level is worth its draft pass (None: every level is)."""
    topk = min(tree.eagle_topk, budget, root.shape[-1])  # no more than the draft scores
    steps = min(tree.num_steps, budget)
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    depths: list[int] = []

    def add_children(rows: torch.Tensor, under: list[int]) -> list[int]:
        """Each parent's top-k children as candidates; returns the new node ids."""
        best, ids = torch.topk(rows, topk, dim=-1)
        if to_target is not None:
            ids = to_target(ids)
        added = []
        for row, parent in enumerate(under):
            base = scores[parent] if parent >= 0 else 0.0
            depth = depths[parent] + 1 if parent >= 0 else 1
            for logp, token in zip(best[row].tolist(), ids[row].tolist(), strict=True):
                tokens.append(int(token))
                parents.append(parent)
                # Clamped: a rounding error above 0 could rank a child above its parent.
                scores.append(base + min(0.0, float(logp)))
                depths.append(depth)
                added.append(len(tokens) - 1)
        return added

    def rank(i: int) -> tuple[float, int, int]:
        return (-scores[i], depths[i], i)

    frontier = add_children(root[None], [-1])
    for _ in range(steps - 1):
        if _settled(frontier, scores, sorted(range(len(tokens)), key=rank), budget):
            break
        if pays is not None and not pays(sum(math.exp(scores[i]) for i in frontier)):
            break
        children = add_children(expand(frontier, tokens, parents), frontier)
        frontier = sorted(children, key=lambda i: (-scores[i], i))[:topk]
    kept = sorted(range(len(tokens)), key=rank)[:budget]
    index = {node: rank for rank, node in enumerate(kept)}
    return DraftTree(
        tokens=[tokens[i] for i in kept],
        parents=tuple(-1 if parents[i] < 0 else index[parents[i]] for i in kept),
        scores=[scores[i] for i in kept],
    )


def _settled(frontier: list[int], scores: list[float], ranked: list[int], budget: int) -> bool:
    """Whether no deeper node can enter the best ``budget``: a descendant of the frontier
    scores at most its frontier ancestor and, deeper than every node so far, loses ties, so
    once ``budget`` nodes score at least the frontier's best, further levels (a draft pass
    each) would all be cut by the re-ranking."""
    return len(ranked) >= budget and max(scores[i] for i in frontier) <= scores[ranked[budget - 1]]


class TreeDepth:
    """Per sequence: whether one more tree level pays for its draft pass.

    The draft's cumulative probability of a node estimates the chance that the target
    accepts its path (EAGLE-2's premise), so a frontier of probability mass m can add at
    most m accepted tokens, each worth a one-token target pass. That mass is scaled by this
    sequence's calibration (accepted tokens over the summed probability of the nodes it
    proposed, shrunk toward 1 with ``PRIOR`` tokens' weight) and the level is grown while
    the tokens it may add are worth more than the draft pass it costs, both as measured
    (``PassCosts.target(1)`` and ``PassCosts.tree_level``, shared by the engine's requests)."""

    PRIOR = 4.0

    def __init__(self, costs: PassCosts, method: str) -> None:
        self.costs = costs
        self.method = method
        self.accepted = 0.0
        self.predicted = 0.0

    @property
    def calibration(self) -> float:
        return (self.accepted + self.PRIOR) / (self.predicted + self.PRIOR)

    def pays(self, mass: float) -> bool:
        plain, level = self.costs.target(1), self.costs.tree_level(self.method)
        if plain is None or level is None:
            return True
        return self.calibration * mass * plain >= level

    def start(self) -> None:
        """A new sequence: its calibration starts again (the level's cost is the draft's)."""
        self.accepted = self.predicted = 0.0

    def record(self, predicted: float, accepted: int) -> None:
        self.predicted += predicted
        self.accepted += accepted


class EagleProposer:
    method: Method = "eagle"
    wants_hidden = True
    proposes_trees = True

    def __init__(
        self,
        draft: EagleDraft,
        tree: EagleTree | None = None,
        trees_allowed: bool = True,
        costs: PassCosts | None = None,
    ) -> None:
        """``trees_allowed`` False (a target that verifies chains only): every level keeps
        one child, so the tree is the draft's greedy chain. ``costs`` (the engine's measured
        pass costs): the tree grows a level only while it pays (``TreeDepth``); None: every
        level up to ``num_steps``."""
        tree = tree or EagleTree()
        if not trees_allowed:
            tree = EagleTree(tree.num_steps, 1, tree.num_draft_tokens)
        self.draft = draft
        self.tree = tree
        self.most_tokens: int | None = tree.num_draft_tokens
        self._depth = None if costs is None else TreeDepth(costs, self.method)
        self._cache = EagleCache()
        self._fed = 0  # committed positions in the draft's cache
        self._pending: list[torch.Tensor] = []  # target features not yet fed
        self._last: torch.Tensor | None = None  # the draft's prediction at position _fed - 1
        # The last proposal: its context length and the summed probability of its nodes.
        self._proposed: tuple[int, float] | None = None

    def fix_shape(self) -> None:
        self._depth = None

    def start(self, prompt_ids: list[int]) -> None:
        self._cache.reset()
        self._fed = 0
        self._pending = []
        self._last = None
        self._proposed = None
        if self._depth is not None:
            self._depth.start()

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        self._pending.append(hidden)

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
        """The best ``min(k, num_draft_tokens)`` nodes of the EAGLE-2 tree after
        ``context``. Deterministic (q is one-hot), so ``processing`` need not shape it."""
        self._catch_up(context)
        budget = min(k, self.tree.num_draft_tokens)
        if self._last is None or budget < 1 or self._fed != len(context) - 1:
            return Proposal([])
        committed = self._fed
        last = self._last
        predicted: dict[int, torch.Tensor] = {}  # node -> the feature its children come from
        slot: dict[int, int] = {}  # node -> its row in the draft cache

        def expand(frontier: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
            started = time.perf_counter()
            rows = level(frontier, tokens, parents)
            if self._depth is not None:
                self._depth.costs.record_tree_level(self.method, time.perf_counter() - started)
            return rows

        def level(frontier: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
            inputs = torch.stack([predicted.get(parents[i], last) for i in frontier])
            depth = [_depth(parents, i) for i in frontier]
            # A node at depth d holds the token at len(context) - 1 + d; the draft reads it
            # beside the feature one position earlier.
            positions = torch.tensor([committed - 1 + d for d in depth], device=inputs.device)
            cached = self._cache.length
            allowed = torch.zeros((len(frontier), cached + len(frontier)), dtype=torch.bool)
            allowed[:, :committed] = True
            for row, node in enumerate(frontier):
                allowed[row, cached + row] = True
                ancestor = parents[node]
                while ancestor >= 0:
                    allowed[row, slot[ancestor]] = True
                    ancestor = parents[ancestor]
            ids = torch.tensor([[tokens[i] for i in frontier]], device=inputs.device)
            out, keys, values = self.draft(
                inputs[None], ids, positions, self._cache.past(), allowed.to(inputs.device)
            )
            self._cache.append(keys, values)
            for row, node in enumerate(frontier):
                slot[node] = cached + row
                predicted[node] = out[0, row]
            return torch.log_softmax(self.draft.logits(out[0]).float(), dim=-1)

        root = torch.log_softmax(self.draft.logits(last).float(), dim=-1)
        pays = None if self._depth is None else self._depth.pays
        grown = grow_tree(root, expand, self.tree, budget, self.draft.to_target, pays)
        self._cache.truncate(committed)
        self._proposed = (len(context), sum(math.exp(score) for score in grown.scores))
        return Proposal(grown.tokens, parents=grown.parents)

    def _catch_up(self, context: list[int]) -> None:
        """Feed the draft every committed position whose target feature has arrived: the
        feature at t beside the token at t + 1."""
        if not self._pending:
            return
        weight = self.draft.fusion_fc.weight
        features = torch.cat(self._pending).to(device=weight.device, dtype=weight.dtype)
        self._pending = []
        start, count = self._fed, features.shape[0]
        if start + count >= len(context):
            raise ValueError("target features arrived for positions without a next token")
        ids = torch.tensor([context[start + 1 : start + 1 + count]], device=weight.device)
        positions = torch.arange(start, start + count, device=weight.device)
        out, keys, values = self.draft(features[None], ids, positions, self._cache.past())
        self._cache.append(keys, values)
        self._fed += count
        self._last = out[0, -1]

    def accepted(self, context: list[int]) -> None:
        self._cache.truncate(self._fed)
        if self._proposed is not None and self._depth is not None:
            before, predicted = self._proposed
            self._depth.record(predicted, len(context) - before - 1)
        self._proposed = None


def _depth(parents: list[int], node: int) -> int:
    depth = 1
    while parents[node] >= 0:
        node = parents[node]
        depth += 1
    return depth


class EagleOptions(BaseModel):
    """EAGLE-2's keys in the speculative configuration (SGLang's names)."""

    model_config = ConfigDict(extra="forbid")

    num_steps: int = Field(
        default=5, ge=1, le=MAX_SPECULATIVE_TOKENS,
        description="EAGLE-2: depth levels the draft tree grows (SGLang's "
        "speculative_num_steps)."
    )  # fmt: skip
    eagle_topk: int = Field(
        default=8, ge=1, le=16, description="EAGLE-2: children per expanded node, and nodes "
        "expanded per level (SGLang's speculative_eagle_topk)."
    )  # fmt: skip
    num_draft_tokens: int = Field(
        default=16, ge=1, le=MAX_SPECULATIVE_TOKENS,
        description="EAGLE-2: nodes kept after re-ranking by cumulative draft probability "
        "(SGLang's speculative_num_draft_tokens); k, fixed or adaptive, bounds it further."
    )  # fmt: skip

    def tree(self) -> EagleTree:
        return EagleTree(self.num_steps, self.eagle_topk, self.num_draft_tokens)


def _holds_eagle_draft(directory: Path) -> bool:
    return heads_method(directory) == "eagle"


def _load(context: LoadContext) -> LoadedMethod:
    """The EAGLE draft in ``config.heads`` (vLLM's ``speculators`` format), over the target's
    own embedding and LM head; one trained on another version of the target is refused
    (``engine.training.heads.eagle.load_eagle``), and so are heads of another kind."""
    options = context.config.speculative.options_for("eagle")
    assert isinstance(options, EagleOptions)
    tree = options.tree()
    return load_heads_method(
        context, EAGLE, "eagle", eagle_for,
        lambda draft, trees_allowed: EagleProposer(draft, tree, trees_allowed, context.costs),
    )


EAGLE = register(
    MethodSpec(
        name="eagle",
        vllm_names=("eagle",),
        options=EagleOptions,
        artefact=ArtefactSpec("eagle_heads", "heads", "heads"),
        recognises=_holds_eagle_draft,
        load=_load,
    )
)
