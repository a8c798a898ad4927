"""How one sequence's proposal is drawn from a draft model's logits, a token per draft pass
(``Drafting``), over what the draft may propose (``DraftHead``); and how much of a draft cache
a committed sequence keeps (``agreeing_prefix``). Used by the draft pool
(``engine.speculation.proposers.draft``), which runs the passes.

Given ``min_confidence`` a proposal stops after a token the draft is unsure of (its probability,
or for a sampled token the draft's top probability, below the threshold), like Hugging Face's
``assistant_confidence_threshold``: a distilled draft is unsure exactly where the target tends
to disagree, so the passes it would spend past that point are mostly wasted. Where the proposal
stops depends only on the draft's own state, so verification stays exact.

The draft proposes only ids below ``proposable_ids`` (the ids its tokenizer shares with the
target's, padded embedding rows excluded) and hands its probabilities over the target's
``target_ids`` (zero beyond), so a draft padded to another size verifies like any other.
A draft whose head covers a frequency-ranked subset of the vocabulary (``vocabulary``, the
sorted ids its head rows stand for; see ``engine.speculation.proposers.vocabulary``) scores only
those rows and proposes only those tokens: q is 0 elsewhere, which rejection sampling handles like
any other q.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.api.types import SamplingParams
from engine.models.loading import input_rows
from engine.speculation.logits_processors import LogitsProcessing
from engine.speculation.proposers.base import Proposal
from engine.speculation.sampling import probabilities, sample


class DraftHead:
    """What the draft may propose and how its logits map onto the target's ids."""

    def __init__(
        self,
        model: torch.nn.Module,
        target_ids: int,
        proposable_ids: int,
        vocabulary: torch.Tensor | None = None,
    ) -> None:
        self.target_ids = target_ids
        self.vocabulary = vocabulary
        # Ids the draft can read (its input embeddings; the head may be a subset).
        self.draft_ids = input_rows(model)  # type: ignore[arg-type]
        # The head rows it may propose from: a prefix, since a subset's ids are sorted.
        self.rows = (
            proposable_ids
            if vocabulary is None
            else int(torch.searchsorted(vocabulary, proposable_ids).item())
        )

    def readable(self, tokens: list[int]) -> bool:
        return all(t < self.draft_ids for t in tokens)

    def token(self, row: int) -> int:
        return row if self.vocabulary is None else int(self.vocabulary[row])

    def over_target_ids(self, q: torch.Tensor, fill: float) -> torch.Tensor:
        """Values over the head's rows placed on the target's ids, ``fill`` everywhere else."""
        if self.vocabulary is None:
            return torch.nn.functional.pad(q, (0, self.target_ids - len(q)), value=fill)
        full = q.new_full((self.target_ids,), fill)
        full[self.vocabulary[: self.rows].to(q.device)] = q
        return full


@dataclass
class Drafting:
    """One sequence's proposal being drawn, a token per draft pass, with its own generator."""

    head: DraftHead
    k: int
    params: SamplingParams
    generator: torch.Generator
    min_confidence: float = 0.0
    processing: LogitsProcessing | None = None
    tokens: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    done: bool = False

    def take(self, logits: torch.Tensor) -> int | None:
        """Draw the next token from the draft's last logits row; None once the proposal is
        complete (k tokens, a token it is unsure of, or nothing the constraints allow)."""
        logits = logits[: self.head.rows]
        head, params, min_confidence = self.head, self.params, self.min_confidence
        if self.processing is not None:
            # Processed over the target's ids, as the target's rows are: the draft's
            # logits placed on their ids, -inf where the draft cannot propose.
            full = head.over_target_ids(logits, float("-inf"))
            full = self.processing.apply(full.unsqueeze(0), [self.tokens])[0]
            if not torch.isfinite(full.amax()):
                self.done = True  # the draft has no token the constraints allow here
                return None
            index = int(full.argmax().item())
            if params.greedy:
                token = index
                sure = min_confidence <= 0.0 or bool(
                    torch.softmax(full, dim=-1)[index] >= min_confidence
                )
            else:
                q = probabilities(full, params)
                token = sample(q, self.generator)
                self.rows.append(q)
                sure = bool(q.max() >= min_confidence)
        elif params.greedy:
            index = int(logits.argmax().item())
            token = head.token(index)
            sure = min_confidence <= 0.0 or bool(
                torch.softmax(logits, dim=-1)[index] >= min_confidence
            )
        else:
            q = head.over_target_ids(probabilities(logits, params), 0.0)
            token = sample(q, self.generator)
            self.rows.append(q)
            sure = bool(q.max() >= min_confidence)
        self.tokens.append(token)
        self.done = not sure or len(self.tokens) >= self.k
        return None if self.done else token

    def proposal(self) -> Proposal:
        return Proposal(self.tokens, probs=torch.stack(self.rows) if self.rows else None)


def agreeing_prefix(cached: list[int], agreed: int, context: list[int]) -> int:
    """How much of the draft's cached tokens the committed ``context`` keeps: everything up
    to ``agreed`` (the context at the last proposal), then as long as they match."""
    keep = min(agreed, len(cached))
    limit = min(len(cached), len(context))
    while keep < limit and cached[keep] == context[keep]:
        keep += 1
    return keep

