"""The one seam between the gateway and whatever generates tokens.

Routes, recording, telemetry and the audit code depend only on what is defined here; the
built-in engine (``gateway.backends.local``) is one implementation. The shared vocabulary of
requests, deltas, results, statistics and errors is ``engine.api.types``, which has no torch or
model code in it, so a remote backend can speak it too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from engine.api.chat import DEFAULT_TEMPLATE, TemplateOptions
from engine.api.types import (
    CompiledConstraint,
    Constraint,
    GenerationRequest,
    GenerationResult,
    Method,
    StreamDelta,
)

# Where a speculative greedy output first leaves plain greedy decoding: called with the prompt's
# ids, the plain output's and the other's; the position and the target's logit gap there
# (``engine.speculation.divergence.Divergence.as_dict``), None when no token differs. CPU work:
# off the event loop.
DivergenceFinder = Callable[[Sequence[int], Sequence[int], Sequence[int]], dict[str, object] | None]


class SpeedupEstimate(Protocol):
    """The estimated speedup over plain decoding of requests that proposed ``drafted`` tokens
    with ``method`` in ``drafts`` of their ``passes`` target passes and kept ``accepted``, at
    the backend's measured pass costs; None before they are measured."""

    def __call__(
        self, method: Method, drafted: int, accepted: int, drafts: int, passes: int
    ) -> float | None: ...


@dataclass(frozen=True)
class BackendCard:
    """What a backend serves: the model and its versioned artefacts, recorded in the audit
    log and answered by ``GET /v1/models``. ``speculative_config`` is in vLLM's
    ``--speculative-config`` terms (JSON-ready); ``default_method`` is what a request that
    asks for nothing gets."""

    model_name: str
    target_version: str
    max_context: int
    vocab_size: int
    available_methods: tuple[Method, ...]
    speculative_config: dict[str, Any]
    default_method: Method
    default_num_speculative_tokens: int | None
    # How tool calls are read from output text (``engine.api.tool_parsers``; vLLM's
    # ``--tool-call-parser``): chosen by the chat template unless configured.
    tool_call_parser: str = "hermes"
    # How requests share the model: "continuous (max_num_seqs=N)", or one at a time and why.
    batching: str = "one request at a time"
    # Versioned artefacts besides the target (a draft model, heads): {"kind", "name",
    # "version"} each (``engine.speculation.methods.Artefact``); version None where a remote server
    # does not report it.
    artefacts: tuple[dict[str, str | None], ...] = ()
    # The dtype the target is served in and why (``engine.models.dtype_choice.DtypeChoice``); None
    # where a remote server does not report it.
    dtype: dict[str, Any] | None = None

    def has_artefact(self, kind: str) -> bool:
        return any(artefact["kind"] == kind for artefact in self.artefacts)


@dataclass(frozen=True)
class BackendHealth:
    """Whether the backend can take requests now, and if not, why (for ``/readyz``)."""

    ready: bool
    detail: str | None = None


class Generation(Protocol):
    """One submitted choice. Its deltas end with one carrying ``finish_reason`` and stats;
    ``put`` ends it early with an error (the gateway's shutdown does this)."""

    def cancel(self) -> None: ...

    def put(self, item: StreamDelta | BaseException) -> None: ...

    def deltas(self) -> AsyncIterator[StreamDelta]: ...

    async def result_async(self) -> GenerationResult: ...


class GenerationBackend(Protocol):
    """A source of generations. Template rendering and tokenizing are CPU work: callers run
    ``render_chat`` and ``tokenize`` off the event loop. ``submit`` does not block: it
    queues the request or raises an ``engine.api.types.EngineError`` (queue full, closed, bad
    request)."""

    @property
    def card(self) -> BackendCard: ...

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: TemplateOptions = DEFAULT_TEMPLATE,
    ) -> tuple[str, tuple[int, ...]]:
        """The prompt text for chat messages and tools (rendered as ``options`` ask: by
        default with the generation prompt added) and its token ids."""
        ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """Token ids of a plain completion prompt (without special tokens: of a fragment,
        such as one of ``bad_words``)."""
        ...

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, special tokens kept (vLLM's ``/detokenize``)."""
        ...

    def compile_constraint(self, constraint: Constraint) -> CompiledConstraint:
        """Check an output constraint before the request is audited, so that one the backend
        cannot serve is the client's 400 and leaves no record; raises
        ``engine.api.types.InvalidRequestError``. CPU work: off the event loop."""
        ...

    def submit(self, request: GenerationRequest) -> Generation: ...

    def health(self) -> BackendHealth: ...

    @property
    def queue_depth(self) -> int:
        """Requests waiting for the backend (a gauge read at scrape time)."""
        ...

    def fallback_state(self) -> dict[Method, bool]:
        """Per speculation method: whether it is switched off now."""
        ...

    @property
    def speculation_crossover(self) -> Callable[[Method], float] | None:
        """Per speculation method, the batch size beyond which speculating stops paying (a
        gauge read at scrape time). None: not offered, by a backend that does not batch with
        adaptive speculation (vLLM)."""
        ...

    @property
    def speculation_speedup(self) -> SpeedupEstimate | None:
        """The speedup estimate of the engine's fallback for figures counted by the gateway
        (its per-workload acceptance windows). None: not offered, by a backend that does not
        measure pass costs (vLLM)."""
        ...

    @property
    def divergence(self) -> DivergenceFinder | None:
        """Where a speculative greedy output first leaves plain greedy decoding, with the
        target's logit gap there (what ``specgate audit replay`` reports). None: not offered,
        by a backend that does not see the target's logits (vLLM)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ReplicatedBackend(Protocol):
    """A backend spread over remote replicas (vLLM): the app audits and counts each replica
    taken out or put back (``gateway.backends.vllm_replicas.ReplicaEvent``, whose
    ``as_dict`` is the `backend_replica` event) and exposes their state in the metrics."""

    def watch_replicas(self, listener: Callable[[Any], None]) -> None: ...

    def replica_states(self) -> list[tuple[str, Any, bool, int]]:
        """(url, pool, in rotation, requests in flight) per replica."""
        ...
