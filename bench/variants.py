"""The decoding variants a benchmark compares, and how each one generates.

Specgate's variants go through ``engine.serving.service.Engine`` exactly as the gateway uses it;
Hugging Face's run ``model.generate`` on the same loaded weights (same dtypes), so the two
columns differ only in the decoding loop.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

import torch
from transformers import GenerationMixin, PreTrainedModel

from engine.api.types import (
    GenerationRequest,
    GenerationStats,
    Method,
    SamplingParams,
    SpeculativeChoice,
)
from engine.serving.service import Engine

Backend = Literal["specgate", "hf"]

# Hugging Face's documented example value for prompt lookup decoding.
HF_PROMPT_LOOKUP_TOKENS = 10


@dataclass(frozen=True)
class Variant:
    backend: Backend
    method: Method
    k: int | None  # None: adaptive (Specgate) or the library default (Hugging Face)

    @property
    def label(self) -> str:
        if self.backend == "hf":
            return {"none": "HF plain", "ngram": "HF prompt lookup", "draft": "HF assisted"}[
                self.method
            ]
        if self.method == "none":
            return "none"
        return f"{self.method} k={'auto' if self.k is None else self.k}"


@dataclass(frozen=True)
class Run:
    token_ids: tuple[int, ...]
    seconds: float
    stats: GenerationStats | None


def specgate_variants(methods: tuple[Method, ...], fixed_k: int) -> list[Variant]:
    variants = [Variant("specgate", "none", None)]
    for method in methods:
        if method != "none":
            variants += [Variant("specgate", method, None), Variant("specgate", method, fixed_k)]
    return variants


# Methods with a Hugging Face equivalent (transformers has no Medusa heads).
HF_METHODS: frozenset[Method] = frozenset({"none", "ngram", "draft"})


def hf_variants(methods: tuple[Method, ...]) -> list[Variant]:
    return [Variant("hf", method, None) for method in methods if method in HF_METHODS]


class Generator:
    """Runs one variant on one prompt, greedily, and times it from request to last token.
    ``engines``: the engine serving each Specgate method (one engine holds one heads
    directory, so Medusa and EAGLE come from engines of their own)."""

    def __init__(
        self,
        engines: Mapping[Method, Engine],
        target: PreTrainedModel,
        draft: PreTrainedModel | None,
    ):
        self.engines = engines
        self.target = target
        self.draft = draft
        self.end_ids = _end_ids(target)

    def run(
        self,
        variant: Variant,
        prompt_ids: tuple[int, ...],
        max_tokens: int,
        sampling: SamplingParams | None = None,
    ) -> Run:
        """``sampling``: a Specgate variant's parameters (default: greedy, ``max_tokens``);
        Hugging Face's variants always run greedily."""
        if variant.backend == "specgate":
            return self._specgate(variant, prompt_ids, max_tokens, sampling)
        return self._hf(variant, prompt_ids, max_tokens)

    def _specgate(
        self,
        variant: Variant,
        prompt_ids: tuple[int, ...],
        max_tokens: int,
        sampling: SamplingParams | None,
    ) -> Run:
        request = GenerationRequest(
            prompt_ids=prompt_ids,
            sampling=sampling or SamplingParams(max_tokens=max_tokens, temperature=0.0),
            speculative=SpeculativeChoice(method=variant.method, num_speculative_tokens=variant.k),
        )
        start = time.perf_counter()
        result = self.engines[variant.method].generate(request)
        return Run(result.token_ids, time.perf_counter() - start, result.stats)

    @torch.inference_mode()
    def _hf(self, variant: Variant, prompt_ids: tuple[int, ...], max_tokens: int) -> Run:
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.target.device)
        options: dict[str, object] = {}
        if variant.method == "draft":
            options["assistant_model"] = self.draft
        elif variant.method == "ngram":
            options["prompt_lookup_num_tokens"] = HF_PROMPT_LOOKUP_TOKENS
        start = time.perf_counter()
        output = cast(GenerationMixin, self.target).generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            **options,
        )
        seconds = time.perf_counter() - start
        return Run(self._until_end(output[0, len(prompt_ids) :].tolist()), seconds, None)

    def _until_end(self, tokens: list[int]) -> tuple[int, ...]:
        """Hugging Face keeps the end-of-sequence token in its output; Specgate does not."""
        for index, token in enumerate(tokens):
            if token in self.end_ids:
                return tuple(tokens[:index])
        return tuple(tokens)


def _end_ids(model: PreTrainedModel) -> frozenset[int]:
    configured = model.generation_config.eos_token_id
    if configured is None:
        return frozenset()
    return frozenset([configured] if isinstance(configured, int) else configured)
