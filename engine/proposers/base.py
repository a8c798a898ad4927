"""The proposer interface: propose tokens, then learn what the target accepted.

A proposer sees the committed sequence (prompt plus output so far) and guesses up to ``k``
continuation tokens, with the probabilities it drew them from when it samples. After
verification the engine tells it the new committed sequence, so it can roll back or update
its own state. Medusa or EAGLE heads fit the same two calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.types import Method, SamplingParams

if TYPE_CHECKING:
    from engine.logits_processors import LogitsProcessing


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    # [len(tokens), vocab] probabilities each token was drawn from; None for a deterministic
    # proposer (its q is one-hot), and always None for greedy requests.
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    method: Method

    def start(self, prompt_ids: list[int]) -> None:
        """A new request begins with this prompt."""

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
