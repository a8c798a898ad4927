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

from array import array
from dataclasses import dataclass

import torch

from engine.api.types import MAX_SPECULATIVE_TOKENS, Method, SamplingParams
from engine.speculation.logits_processors import LogitsProcessing
from engine.speculation.methods import LoadContext, LoadedMethod, MethodSpec, register
from engine.speculation.proposers.base import Proposal, TokenProposer

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


class SuffixIndex:
    """Where every n-gram (n from ``min_n`` to ``max_n``) of a growing sequence occurs, kept up
    to date as the sequence grows, so that finding the match for the next proposal is a
    dictionary lookup and a comparison of its latest candidates.

    Scanning the whole sequence for the suffix n-gram instead cost 300-700 microseconds a step
    on real text (two CPU cores), and adaptive k reads the copy in progress (``expected_run``)
    after every step of every n-gram sequence, plain steps included: at 8 sequences that was
    0.30 s of 16 s of decoding (about 2 %), against 0.011 s with this index. Indexing costs
    about half a microsecond per token and n; a sequence that is not an extension of the one
    indexed (a proposer shared between sequences) is indexed afresh.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # n-gram -> the positions its continuations start at, in order. Keys of different n
        # share the dictionary: tuples of different lengths are never equal. The positions
        # are arrays, which the garbage collector does not track: a list per n-gram would add
        # about three tracked objects per token, walked by every full collection.
        self._starts: dict[tuple[int, ...], array[int]] = {}
        self._match: Match | None = None
        self._matched_size = -1  # the sequence length ``_match`` was found at
        # The list last indexed. The engine's sequences only ever grow, in place, so that
        # same list is taken to extend what was indexed without comparing it again (twice a
        # step, up to 8,000 tokens each time): had a caller changed it otherwise, proposals
        # would be worse, never the output, which verification decides.
        self._followed: list[int] | None = None

    def follow(self, context: list[int]) -> None:
        """Index ``context`` (usually what was indexed so far and a few tokens more)."""
        size = len(self.tokens)
        extends = context is self._followed and len(context) >= size
        if not extends and (len(context) < size or context[:size] != self.tokens):
            self.tokens, self._starts, self._matched_size, size = [], {}, -1, 0
        self._followed = context
        tokens = self.tokens
        tokens.extend(context[size:])
        starts = self._starts
        for end in range(size + 1, len(tokens) + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n : end])
                found = starts.get(key)
                if found is None:
                    starts[key] = array("q", (end,))
                else:
                    found.append(end)

    def match(self) -> Match | None:
        """The earlier occurrence of the longest suffix n-gram that agrees with the sequence
        for the most tokens back, the latest among equals (up to ``ALIGNMENT_CAP`` tokens,
        among the ``MATCH_CANDIDATES`` latest)."""
        tokens = self.tokens
        size = len(tokens)
        if self._matched_size != size:
            self._match, self._matched_size = self._find(tokens), size
        return self._match

    def _find(self, tokens: list[int]) -> Match | None:
        size = len(tokens)
        cap = min(ALIGNMENT_CAP, size - 1)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # The last start is the suffix's own (its continuation would begin at ``size``).
            starts = self._starts.get(tuple(tokens[size - n :]), ())
            if len(starts) < 2:
                continue
            known = min(n, cap)
            best_start, best = 0, -1
            for start in reversed(starts[-1 - MATCH_CANDIDATES : -1]):
                # Only a longer agreement replaces the best (the latest wins among equals),
                # so one comparison of as many tokens turns most candidates away; each
                # replacement then counts on from there, so the counting adds up to at most
                # twice the cap for all of them.
                need = best + 1
                if need > min(cap, start):
                    continue
                if need > known and tokens[start - need : start] != tokens[size - need :]:
                    continue
                best_start, best = start, _agreement(tokens, start, max(need, known), cap)
                if best == cap:
                    break
            return Match(best_start, max(n, best))
        return None


def _agreement(tokens: list[int], start: int, known: int, cap: int) -> int:
    """How many tokens before ``start`` equal the sequence's last ones, counted from
    ``start - 1`` and the last token back, at most ``cap``; the first ``known`` are equal."""
    before, last = start - 1, len(tokens) - 1
    count = known
    while count < cap and before - count >= 0 and tokens[before - count] == tokens[last - count]:
        count += 1
    return count


def find_match(context: list[int], min_n: int, max_n: int) -> Match | None:
    """``SuffixIndex.match`` of ``context`` indexed once."""
    index = SuffixIndex(min_n, max_n)
    index.follow(context)
    return index.match()


def continuation(context: list[int], match: Match | None, k: int) -> list[int]:
    """``k`` tokens copied from ``match`` on, overlapping the end as LZ77 copies do."""
    if match is None or k < 1:
        return []
    period = len(context) - match.start
    return [context[match.start + i % period] for i in range(k)]


def lookup(context: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """``k`` tokens continuing the best-aligned earlier match of the longest suffix n-gram."""
    return continuation(context, find_match(context, min_n, max_n) if k >= 1 else None, k)


class NgramProposer(TokenProposer):
    """Prompt lookup over its own ``SuffixIndex`` of the request's committed sequence."""

    method: Method = "ngram"
    proposes_trees = False
    most_tokens: int | None = None

    def __init__(self, min_n: int, max_n: int) -> None:
        self.index = SuffixIndex(min_n, max_n)

    def start(self, prompt_ids: list[int]) -> None:
        self.index.follow(prompt_ids)

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        min_confidence: float = 0.0,
        processing: LogitsProcessing | None = None,
    ) -> Proposal:
        if k < 1:
            return Proposal([])
        return Proposal(continuation(context, self._match(context), k))

    def accepted(self, context: list[int]) -> None:
        self.index.follow(context)

    def expected_run(self, context: list[int]) -> int:
        """The copy so far: how many tokens the match behind the next proposal has agreed."""
        match = self._match(context)
        return 0 if match is None else match.aligned

    def _match(self, context: list[int]) -> Match | None:
        self.index.follow(context)
        return self.index.match()


def _load(context: LoadContext) -> LoadedMethod:
    speculative = context.config.speculative
    low, high = speculative.prompt_lookup_min, speculative.prompt_lookup_max
    return LoadedMethod(lambda: NgramProposer(low, high))  # each request its own index


NGRAM = register(MethodSpec(name="ngram", vllm_names=("ngram",), load=_load))
