"""Prompt lookup decoding: find an earlier occurrence of the sequence's last n tokens (n from
``max_n`` down to ``min_n``) and propose the tokens that followed it.

The continuation is copied as LZ77 copies, overlapping itself: where it reaches the end of the
sequence it goes on with the tokens it has just proposed. Without that, a proposal taken from
a recent match in text that repeats with period p could never be longer than p tokens.
Hugging Face's prompt lookup takes the earliest match instead, which avoids that limit but
proposes from the staler part of the sequence.

Of the earlier occurrences of that n-gram, the one whose text before it agrees with the
sequence's for the most tokens is used (the latest among equals): where an answer quotes a
given text, that is the quoted source, while the latest occurrence of a short n-gram is often
in the answer's own recent lines, which the quote continues differently. How far the two
agree (``Match.aligned``, the copy so far) is also the proposer's evidence of how long the
copy will go on (``expected_run``): adaptive k may look that far ahead at once, instead of one
token further per fully accepted step.

Registered as the method ``ngram`` (vLLM's name too); it loads nothing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.logits_processors import LogitsProcessing
from engine.methods import LoadContext, LoadedMethod, MethodSpec, register
from engine.proposers.base import Proposal
from engine.types import MAX_SPECULATIVE_TOKENS, Method, SamplingParams

# The latest occurrences of the suffix n-gram compared for alignment (a short n-gram can occur
# thousands of times in a long context), and the most tokens of agreement counted: beyond
# the longest proposal there is nothing to tell matches apart by.
MATCH_CANDIDATES = 256
ALIGNMENT_CAP = MAX_SPECULATIVE_TOKENS


@dataclass(frozen=True)
class Match:
    """An earlier occurrence of the sequence's last tokens."""

    start: int  # where the tokens that followed it begin
    aligned: int  # how many tokens before ``start`` equal the sequence's last ones (>= n)


def find_match(context: list[int], min_n: int, max_n: int) -> Match | None:
    """The earlier occurrence of the longest suffix n-gram (n from ``max_n`` down to
    ``min_n``) that agrees with the sequence for the most tokens back, the latest among
    equals (up to ``ALIGNMENT_CAP`` tokens, among the ``MATCH_CANDIDATES`` latest)."""
    size = len(context)
    if size < 2:
        return None
    ids = torch.tensor(context, dtype=torch.long)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # Windows starting before the suffix itself: starts 0 .. size-n-1.
        windows = ids[: size - 1].unfold(0, n, 1)
        hits = (windows == ids[size - n :]).all(dim=1).nonzero().flatten()
        if len(hits):
            starts = hits[-MATCH_CANDIDATES:] + n
            aligned = _aligned(ids, starts, min(ALIGNMENT_CAP, size - 1))
            best = int(torch.argmax(aligned.flip(0)))  # argmax takes the first: the latest
            index = len(starts) - 1 - best
            return Match(int(starts[index]), max(n, int(aligned[index])))
    return None


def _aligned(ids: torch.Tensor, starts: torch.Tensor, cap: int) -> torch.Tensor:
    """Per start s, the number of tokens before s that equal the sequence's last ones, in
    order from s - 1 and the last token back (at most ``cap``)."""
    back = torch.arange(cap)
    source = starts[:, None] - 1 - back
    equal = (source >= 0) & (ids[source.clamp(min=0)] == ids[len(ids) - 1 - back])
    return equal.to(torch.long).cumprod(dim=1).sum(dim=1)


def lookup(context: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """``k`` tokens continuing the best-aligned earlier match of the longest suffix n-gram."""
    match = find_match(context, min_n, max_n) if k >= 1 else None
    if match is None:
        return []
    period = len(context) - match.start
    return [context[match.start + i % period] for i in range(k)]


class NgramProposer:
    method: Method = "ngram"
    proposes_trees = False
    most_tokens: int | None = None

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def start(self, prompt_ids: list[int]) -> None:
        return None

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        min_confidence: float = 0.0,
        processing: LogitsProcessing | None = None,
    ) -> Proposal:
        return Proposal(lookup(context, k, self.min_n, self.max_n))

    def accepted(self, context: list[int]) -> None:
        return None

    def expected_run(self, context: list[int]) -> int:
        """The copy so far: how many tokens the match behind the next proposal has agreed."""
        match = find_match(context, self.min_n, self.max_n)
        return 0 if match is None else match.aligned


def _load(context: LoadContext) -> LoadedMethod:
    speculative = context.config.speculative
    # No state between calls, so every request can share one proposer.
    proposer = NgramProposer(speculative.prompt_lookup_min, speculative.prompt_lookup_max)
    return LoadedMethod(lambda: proposer)


NGRAM = register(MethodSpec(name="ngram", vllm_names=("ngram",), load=_load))
