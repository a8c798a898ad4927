"""Prompt lookup decoding: find the latest earlier occurrence of the sequence's last n tokens
(n from ``max_n`` down to ``min_n``) and propose the tokens that followed it.

The continuation is copied as LZ77 copies, overlapping itself: where it reaches the end of the
sequence it goes on with the tokens it has just proposed. Without that, a proposal taken from
the latest match in text that repeats with period p could never be longer than p tokens.
Hugging Face's prompt lookup takes the earliest match instead, which avoids that limit but
proposes from the staler part of the sequence.

Registered as the method ``ngram`` (vLLM's name too); it loads nothing."""

from __future__ import annotations

import torch

from engine.logits_processors import LogitsProcessing
from engine.methods import LoadContext, LoadedMethod, MethodSpec, register
from engine.proposers.base import Proposal
from engine.types import Method, SamplingParams


def lookup(context: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """``k`` tokens continuing the most recent earlier match of the longest suffix n-gram."""
    size = len(context)
    if size < 2 or k < 1:
        return []
    ids = torch.tensor(context, dtype=torch.long)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # Windows starting before the suffix itself: starts 0 .. size-n-1.
        windows = ids[: size - 1].unfold(0, n, 1)
        hits = (windows == ids[size - n :]).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[-1].item()) + n
            period = size - start
            return [context[start + i % period] for i in range(k)]
    return []


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


def _load(context: LoadContext) -> LoadedMethod:
    speculative = context.config.speculative
    # No state between calls, so every request can share one proposer.
    proposer = NgramProposer(speculative.prompt_lookup_min, speculative.prompt_lookup_max)
    return LoadedMethod(lambda: proposer)


NGRAM = register(MethodSpec(name="ngram", vllm_names=("ngram",), load=_load))
