"""The proposer interface: propose a tree of tokens, then learn what the target accepted.

A proposer sees the committed sequence (prompt plus output so far) and guesses up to ``k``
continuation tokens, as a chain (n-gram lookup, a draft model) or a tree (Medusa, EAGLE),
with the probabilities it drew them from when it samples. After verification the engine
tells it the new committed sequence, so it can roll back or update its own state. A proposer
that drafts from the target's own features (``wants_hidden``) is handed the target's last
hidden states of the committed positions through ``observe_hidden`` before each proposal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from engine.api.types import Method, SamplingParams
from engine.speculation.tree import chain_parents

if TYPE_CHECKING:
    from engine.speculation.logits_processors import LogitsProcessing


@dataclass(frozen=True)
class Proposal:
    """Node tokens in topological order (a node after its parent).

    ``parents``: each node's parent index, -1 for a child of the last committed token; None
    means a chain (-1, 0, 1, ..., n-2). ``probs``: ``[n, vocab]``, the distribution node i
    was drawn from, after the same logits processing as the target's; None for a
    deterministic proposer (its q is one-hot), and always None for greedy requests.
    """

    tokens: list[int]
    parents: tuple[int, ...] | None = None
    probs: torch.Tensor | None = None

    def parent_indices(self) -> tuple[int, ...]:
        return chain_parents(len(self.tokens)) if self.parents is None else self.parents

    @property
    def is_chain(self) -> bool:
        return self.parents is None or self.parents == chain_parents(len(self.tokens))


class Proposer(Protocol):
    method: Method
    # Drafts trees whose node count is its k and whose cost is one whole proposal's (Medusa's
    # heads, EAGLE's levels): adaptive k then models each node's acceptance (``NodeHits``) and
    # prices a proposal whole (``PassCosts.record_proposal``); False for chains, priced per token.
    proposes_trees: bool
    # The most tokens one proposal holds whatever k asks (a static tree's nodes, EAGLE's
    # ``num_draft_tokens``), so adaptive k never prices nodes it cannot propose; None: k's.
    most_tokens: int | None
    # Drafts from the target's last hidden states (Medusa's heads, EAGLE): the engine hands
    # it those of the committed positions (``observe_hidden``) before each proposal.
    wants_hidden: bool

    def start(self, prompt_ids: list[int]) -> None:
        """A new request begins with this prompt."""

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        """The target's last hidden states ``[n, hidden]`` of the positions just committed
        (the prompt's, then each step's); called only where ``wants_hidden``."""

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        min_confidence: float = 0.0,
        processing: LogitsProcessing | None = None,
    ) -> Proposal:
        """Up to ``k`` tokens that may follow ``context``. A proposer that knows how sure it
        is stops after a token it gives a probability below ``min_confidence``. A proposer
        that draws from logits processes them with ``processing`` first (the tokens it has
        proposed so far as the row's path), exactly as the target's are."""

    def accepted(self, context: list[int]) -> None:
        """Verification committed ``context``; anything proposed beyond it was rejected."""


class TokenProposer:
    """The part of ``Proposer`` common to proposers that draft from tokens alone (n-gram
    lookup, draft models): they need none of the target's hidden states."""

    wants_hidden = False

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        raise TypeError(f"{type(self).__name__} drafts from tokens, not hidden states")


@runtime_checkable
class RunHinting(Protocol):
    """A proposer that can tell from the committed sequence how many tokens it expects to get
    right from there (n-gram lookup: the length of the copy in progress), so that adaptive k
    may look that far ahead before a run of that length has been seen, and judges its
    acceptance by the steps that had a hint like it
    (``engine.speculation.adaptive.hint_bucket``)."""

    def expected_run(self, context: list[int]) -> int:
        """Tokens the proposer expects to get right after ``context``; 0 where it would
        propose nothing (adaptive k then proposes nothing, and does not count a plain step)."""


@runtime_checkable
class ShapeAdapting(Protocol):
    """A proposer whose proposals' shape follows measured costs, which depend on timing and on
    the other requests (EAGLE-2's cost-bounded tree depth)."""

    def fix_shape(self) -> None:
        """Propose the configured shape from now on, whatever the costs: a fixed k is proposed
        whole, and a seeded request or a replay must not depend on timing."""
