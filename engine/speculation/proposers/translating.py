"""A draft model with another tokenizer than the target's, as Hugging Face's universal
assisted decoding pairs them.

The committed sequence is decoded to text and re-encoded with the draft's tokenizer; the
draft continues it greedily in its own tokens; the continuation's text is encoded with the
target's tokenizer after a few committed tokens (so that a token spanning the boundary is
found) and proposed as the target's ids. The proposal is a deterministic guess (q one-hot,
like n-gram lookup's), so verification stays exact for greedy and sampled requests alike;
the draft's own probabilities, over another vocabulary, are never used.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from engine.api.types import Method, SamplingParams
from engine.models.model_runner import ModelRunner
from engine.speculation.logits_processors import LogitsProcessing
from engine.speculation.proposers.base import Proposal, TokenProposer

# Committed target tokens re-encoded with the continuation: a token may span the boundary.
BOUNDARY_TOKENS = 4
# Draft tokens generated per proposed target token asked for (tokenizers split differently).
DRAFT_TOKENS_PER_TARGET = 1.5


def translate(
    target: PreTrainedTokenizerBase, tail: list[int], continuation: str, limit: int
) -> list[int]:
    """Target ids of ``continuation`` after the committed ``tail``: ``tail``'s text plus the
    continuation, encoded, must start with ``tail`` itself (else the tokenizations disagree at
    the boundary and nothing is proposed). The last id is dropped, since the continuation may
    end inside a target token."""
    ids = target.encode(_text(target, tail) + continuation, add_special_tokens=False)
    if ids[: len(tail)] != tail:
        return []
    return ids[len(tail) : -1][:limit]


def _text(tokenizer: PreTrainedTokenizerBase, ids: list[int], **kwargs: bool) -> str:
    text = tokenizer.decode(ids, **kwargs)
    assert isinstance(text, str)
    return text


class TranslatingDraftProposer(TokenProposer):
    method: Method = "draft"
    proposes_trees = False
    most_tokens: int | None = None

    def __init__(
        self,
        runner: ModelRunner,
        target_tokenizer: PreTrainedTokenizerBase,
        draft_tokenizer: PreTrainedTokenizerBase,
        target_ids: int,
        window: int,
    ) -> None:
        self.runner = runner
        self.target_tokenizer = target_tokenizer
        self.draft_tokenizer = draft_tokenizer
        self.target_ids = target_ids
        self.window = window
        self.cached: list[int] = []  # draft ids whose keys and values the draft cache holds

    def start(self, prompt_ids: list[int]) -> None:
        self.runner.reset()
        self.cached = []

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        min_confidence: float = 0.0,
        processing: LogitsProcessing | None = None,
    ) -> Proposal:
        text = _text(self.target_tokenizer, context, skip_special_tokens=True)
        draft_ids = self.draft_tokenizer.encode(text)
        steps = max(2, round(k * DRAFT_TOKENS_PER_TARGET) + 1)
        if not draft_ids or len(draft_ids) + steps > self.window:
            return Proposal([])
        keep = 0
        limit = min(len(self.cached), len(draft_ids) - 1)
        while keep < limit and self.cached[keep] == draft_ids[keep]:
            keep += 1
        self.runner.truncate(keep)
        self.cached = self.cached[:keep]
        pending = draft_ids[keep:]
        generated: list[int] = []
        for _ in range(steps):
            logits = self.runner.forward(pending, last_only=True)[-1]
            self.cached.extend(pending)
            token = int(logits.argmax().item())
            generated.append(token)
            pending = [token]
        continuation = _text(self.draft_tokenizer, generated)
        tail = context[-BOUNDARY_TOKENS:]
        proposal = translate(self.target_tokenizer, tail, continuation, k)
        if any(t >= self.target_ids for t in proposal):
            return Proposal([])
        return Proposal(proposal)

    def accepted(self, context: list[int]) -> None:
        return None  # the next proposal re-encodes the context and keeps the agreeing prefix
