"""The built-in speculative engine as a ``GenerationBackend``.

The only gateway module that imports ``engine.serving.service`` (``gateway.app`` wires it); the rest
of the gateway sees ``gateway.backends.base`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.api.chat import DEFAULT_TEMPLATE, TemplateOptions, render_chat
from engine.api.tool_parsers import parser_for_template
from engine.api.types import (
    CompiledConstraint,
    Constraint,
    FallbackEvent,
    GenerationRequest,
    Method,
)
from engine.config import EngineConfig
from engine.serving.service import Engine, RequestHandle
from engine.speculation.divergence import first_divergence
from gateway.backends.base import (
    BackendCard,
    BackendHealth,
    DivergenceFinder,
    SpeedupEstimate,
)


class LocalBackend:
    """Serves from an in-process ``Engine``; ``engine`` stays reachable for the wiring and
    for tests that look inside it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        spec = engine.speculative_config
        self._card = BackendCard(
            model_name=engine.model_name,
            target_version=engine.target_version,
            max_context=engine.max_context,
            vocab_size=engine.vocab_size,
            available_methods=engine.available_methods,
            speculative_config=spec.model_dump(mode="json"),
            default_method=spec.method,
            default_num_speculative_tokens=spec.num_speculative_tokens,
            tool_call_parser=engine.config.tool_call_parser
            or parser_for_template(getattr(engine.tokenizer, "chat_template", None)),
            batching=engine.batching_mode,
            artefacts=engine.artefacts,
            dtype=engine.dtype_choice.as_record(),
        )

    @classmethod
    def load(
        cls, config: EngineConfig, on_fallback: Callable[[FallbackEvent], None] | None = None
    ) -> LocalBackend:
        return cls(Engine.load(config, on_fallback=on_fallback))

    @property
    def card(self) -> BackendCard:
        return self._card

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: TemplateOptions = DEFAULT_TEMPLATE,
    ) -> tuple[str, tuple[int, ...]]:
        text = render_chat(self.engine.tokenizer, messages, tools, options)
        return text, tuple(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        return tuple(self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(self.engine.tokenizer.decode(list(token_ids)))

    def compile_constraint(self, constraint: Constraint) -> CompiledConstraint:
        return self.engine.compile_constraint(constraint)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        return self.engine.submit(request)

    @property
    def divergence(self) -> DivergenceFinder:
        return self._divergence

    def _divergence(
        self, prompt: Sequence[int], plain: Sequence[int], other: Sequence[int]
    ) -> dict[str, object] | None:
        """Where greedy ``other`` first differs from ``plain`` and the target's logit gap
        there (``engine.speculation.divergence``); None when no token differs. CPU work: off the
        loop."""
        found = first_divergence(self.engine.target_model, prompt, plain, other)
        return None if found is None else found.as_dict()

    def health(self) -> BackendHealth:
        if self.engine.closed:
            return BackendHealth(False, "the engine is shut down")
        return BackendHealth(True)

    @property
    def queue_depth(self) -> int:
        return self.engine.queue_depth

    def fallback_state(self) -> dict[Method, bool]:
        return self.engine.fallback_state()

    @property
    def speculation_crossover(self) -> Callable[[Method], float]:
        return self.engine.speculation_crossover

    @property
    def speculation_speedup(self) -> SpeedupEstimate:
        return self.engine.estimated_speedup

    def close(self) -> None:
        self.engine.close()
