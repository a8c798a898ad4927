"""A submitted request as the engine's caller holds it (``Engine.submit`` returns it) and as
the scheduler queues it. Torch-free: its own module, so that the scheduler and the engine
both import it and neither imports the other."""

from __future__ import annotations

from typing import Any

from opentelemetry import context as otel_context

from engine.api.delta_channel import DeltaChannel
from engine.api.types import GenerationRequest


class RequestHandle(DeltaChannel):
    """A submitted request: iterate for streamed deltas, or call ``result()``; from an event
    loop, ``async for`` over ``deltas()`` or await ``result_async()``
    (``engine.api.delta_channel``).
    """

    def __init__(
        self, request: GenerationRequest, submitted_at: float, grammar: Any = None
    ) -> None:
        super().__init__(keep_logprobs=request.sampling.logprobs is not None)
        self.request = request
        self.submitted_at = submitted_at
        # The request's compiled constraint (compiled at submit, so a bad one is a 400).
        self.grammar = grammar
        self.otel_context = otel_context.get_current()
