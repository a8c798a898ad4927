"""A small draft model proposes k tokens autoregressively with its own KV cache.

Given ``min_confidence`` it stops after a token it is unsure of (its probability, or for a
sampled token the draft's top probability, below the threshold), like Hugging Face's
``assistant_confidence_threshold``: a distilled draft is unsure exactly where the target
tends to disagree, so the passes it would spend past that point are mostly wasted. Where the
proposal stops depends only on the draft's own state, so verification stays exact.
"""

from __future__ import annotations

import torch

from engine.model_runner import ModelRunner
from engine.proposers.base import Proposal
from engine.sampling import probabilities, sample
from engine.types import Method, SamplingParams


class DraftModelProposer:
    method: Method = "draft"

    def __init__(self, runner: ModelRunner, vocabulary: torch.Tensor | None = None) -> None:
        """``vocabulary``: the token ids of a draft head restricted to a subset (see
        ``engine.proposers.vocabulary``, which has already cut the runner's head to them)."""
        self.runner = runner
        self.vocabulary = vocabulary
        self.vocab_size = int(runner.model.config.vocab_size)
        # Token ids whose keys and values the draft cache holds, position for position.
        self.cached: list[int] = []
        # Length of the committed context at the last proposal: the cache agrees up to here.
        self.agreed = 0

    def start(self, prompt_ids: list[int]) -> None:
        self.runner.reset()
        self.cached = []
        self.agreed = 0

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        min_confidence: float = 0.0,
    ) -> Proposal:
        # Feed whatever of the context the cache lacks (the last token, plus any accepted
        # tokens the draft never saw), then extend one token at a time.
        pending = context[len(self.cached) :]
        self.agreed = len(context)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            logits = self.runner.forward(pending, last_only=True)[-1]
            self.cached.extend(pending)
            if params.greedy:
                index = int(logits.argmax().item())
                token = index if self.vocabulary is None else int(self.vocabulary[index])
                sure = min_confidence <= 0.0 or bool(
                    torch.softmax(logits, dim=-1)[index] >= min_confidence
                )
            else:
                q = self._full_vocabulary(probabilities(logits, params))
                token = sample(q, generator)
                rows.append(q)
                sure = bool(q.max() >= min_confidence)
            tokens.append(token)
            if not sure:
                break
            pending = [token]
        return Proposal(tokens, torch.stack(rows) if rows else None)

    def _full_vocabulary(self, q: torch.Tensor) -> torch.Tensor:
        """q over the subset, spread onto the whole vocabulary with 0 outside the subset."""
        if self.vocabulary is None:
            return q
        full = q.new_zeros(self.vocab_size)
        full[self.vocabulary.to(q.device)] = q
        return full

    def accepted(self, context: list[int]) -> None:
        # Keep the cached prefix that agrees with the committed context; drop the rest.
        keep = min(self.agreed, len(self.cached))
        limit = min(len(self.cached), len(context))
        while keep < limit and self.cached[keep] == context[keep]:
            keep += 1
        self.runner.truncate(keep)
        del self.cached[keep:]
