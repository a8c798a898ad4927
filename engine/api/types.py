"""Plain data passed between the engine and its callers (the gateway, the CLI, the benchmark).

Nothing here touches torch, so callers can import these types cheaply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

# A speculation method's name: "none" (plain decoding) or one registered in
# engine.speculation.methods, which checks names where they are configured or requested
# (``RegisteredMethod``).
Method = str
FinishReason = Literal["stop", "length"]
ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
# The most tokens (chain) or nodes (tree) one proposal may hold: the bound of a fixed and of an
# adaptive k everywhere (engine config, gateway settings, requests, EAGLE's tree sizes).
MAX_SPECULATIVE_TOKENS = 32
# The most rows a decode pass feeds one sequence: its last token and a whole proposal.
MAX_STEP_ROWS = MAX_SPECULATIVE_TOKENS + 1
# OpenAI's limit on top_logprobs, used for completions' ``logprobs`` too.
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Constraint:
    """What the output must match (constrained decoding, ``engine.speculation.logits_processors``).

    ``spec`` is the JSON schema's compact JSON text, keys in the order the request gave them
    (``json_schema``: the output's keys follow the order of ``properties``; ``"{}"`` for
    ``json_object``, any JSON object), the regular expression (``regex``), a JSON list of the
    allowed strings (``choice``) or an EBNF grammar in xgrammar's dialect (``grammar``).
    """

    kind: ConstraintKind
    spec: str


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint checked against the served tokenizer before the request is audited
    (``Engine.compile_constraint``): ``grammar`` is what the engine's matcher runs, so the
    engine need not compile it again at submit."""

    constraint: Constraint
    grammar: str


# Where a request's acceptance figures come from: the engine that ran it, the remote
# server's own per-request figures, or the server's counters over an interval
# (gateway.backends.vllm_acceptance).
AcceptanceSource = Literal["engine", "per_request", "interval"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token. ``temperature == 0`` means greedy.

    ``top_k == 0`` and ``top_p == 1.0`` switch those filters off. ``stop`` holds stop
    strings: generation ends at the first token whose text completes one, and the stop
    string itself is not returned (OpenAI's behaviour). ``seed_drawn``: the caller drew
    ``seed`` itself (to record it) for a client that asked for none, so the request is not
    pinned to a fixed k as a client-seeded one is; its adaptive schedule is in the stats.

    The logits processors (``engine.speculation.logits_processors``), all off at their defaults:
    ``presence_penalty``/``frequency_penalty`` subtract from the logit of each token by
    whether/how often it occurs in the output so far (OpenAI's definition);
    ``repetition_penalty`` divides a positive logit (multiplies a negative one) of each token
    seen in prompt or output (vLLM's and Hugging Face's); ``logit_bias`` adds to token ids'
    logits; ``min_tokens`` forbids end-of-sequence and stop tokens before that many output
    tokens; ``constraint`` masks every token the output's grammar does not allow;
    ``allowed_token_ids`` (non-empty) masks every other token; ``bad_words`` (token
    sequences) masks a sequence's last token wherever the output ends with the rest of it.
    ``min_p`` (vLLM's) drops, after temperature, every token whose probability is below
    ``min_p`` times the most likely token's (``engine.speculation.sampling.probabilities``).
    ``include_stop_str_in_output`` keeps the stop string (or stop token's text) that ended
    the output; ``skip_special_tokens`` leaves special tokens out of the text.
    ``logprobs`` asks for the log-probability of each output token and of that many most
    likely alternatives (``None``: none).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    seed_drawn: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    constraint: Constraint | None = None
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor is on (otherwise processing costs nothing)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or bool(self.allowed_token_ids)
            or bool(self.bad_words)
            or self.constraint is not None
        )


@dataclass(frozen=True)
class SpeculativeChoice:
    """A request's choice of decoding method; ``None`` fields take the engine's defaults.

    ``num_speculative_tokens`` set fixes K for this request; left ``None`` the engine
    chooses K adaptively. ``schedule`` (replay of an audited request) gives the number of
    tokens to propose at each step, as ``GenerationStats.proposal_lengths`` recorded them:
    no adaptive choice, no fallback, no confidence cut-off.
    """

    method: Method | None = None
    num_speculative_tokens: int | None = None
    schedule: tuple[int, ...] | None = None


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculative: SpeculativeChoice = field(default_factory=SpeculativeChoice)
    request_id: str | None = None
    # ``sampling.constraint`` compiled already; the engine compiles it itself when this is
    # absent or was compiled from another constraint.
    compiled: CompiledConstraint | None = None


@dataclass(frozen=True)
class Figure:
    """One speculation figure of ``GenerationStats``. ``kind``: ``count`` adds up over
    requests (a Prometheus counter), ``per_position`` is a list of counts by position in the
    accepted run (a counter with a ``position`` label), ``ratio`` is derived from the counts,
    ``label`` and ``flag`` describe the request. ``metric``: the counter's name, for counts;
    ``every_request``: the counter counts requests that did not speculate too (others count
    speculating requests only, so a plain-only server shows no draft series)."""

    name: str
    kind: Literal["count", "per_position", "ratio", "label", "flag"]
    description: str
    metric: str | None = None
    every_request: bool = False


# The one list of speculation figures: the response's ``speculative`` extension, the
# `completion` audit event, the request spans (``specgate.speculative.<name>``) and the
# Prometheus counters all report exactly these, by these names (vLLM's per-request names).
SPECULATION_FIGURES: tuple[Figure, ...] = (
    Figure("method", "label", "The speculation method used (none: plain decoding)."),
    Figure(
        "num_drafts",
        "count",
        "Speculative steps (draft proposals verified).",
        "specgate_spec_decode_num_drafts",
    ),
    Figure(
        "num_draft_tokens",
        "count",
        "Draft tokens proposed.",
        "specgate_spec_decode_num_draft_tokens",
    ),
    Figure(
        "num_accepted_tokens",
        "count",
        "Draft tokens accepted by the target.",
        "specgate_spec_decode_num_accepted_tokens",
    ),
    Figure(
        "num_accepted_tokens_per_pos",
        "per_position",
        "Steps that accepted a token at this position of the accepted run (vLLM's "
        "spec_decode_num_accepted_tokens_per_pos).",
        "specgate_spec_decode_num_accepted_tokens_per_pos",
    ),
    Figure(
        "num_target_passes",
        "count",
        "Forward passes of the target model.",
        "specgate_spec_decode_target_passes",
        every_request=True,
    ),
    Figure("acceptance_rate", "ratio", "Accepted draft tokens / draft tokens proposed."),
    Figure(
        "mean_acceptance_length", "ratio", "Tokens per speculative step: 1 + accepted / drafts."
    ),
    Figure("fallback_active", "flag", "Speculation was switched off for this request."),
    Figure(
        "acceptance_source",
        "label",
        "Where the acceptance figures come from: engine, per_request or interval.",
    ),
)
SPECULATION_FIELDS: tuple[str, ...] = tuple(f.name for f in SPECULATION_FIGURES)
FigureValue = str | int | float | bool | list[int]


@dataclass
class GenerationStats:
    """Per-request figures, named as vLLM names its per-request speculative metrics; the
    speculation figures among them are ``SPECULATION_FIGURES``."""

    method: Method
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_target_passes: int = 0
    fallback_active: bool = False
    time_to_first_token_s: float = 0.0
    total_time_s: float = 0.0
    # Tokens proposed at each target pass (0: none), what a replay needs to draw the same.
    proposal_lengths: list[int] = field(default_factory=list)
    acceptance_source: AcceptanceSource = "engine"
    replica: str | None = None  # the remote server that generated it; None: in-process
    # Accepted tokens by position in the accepted path (vLLM's
    # spec_decode_num_accepted_tokens_per_pos): entry i counts steps that accepted > i tokens.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # The most sequences that one step of this request's decoding ran with (1: alone every
    # step); None where the backend cannot tell (a remote server). What a replay needs to know:
    # outside the batch-invariant mode a step shared in bfloat16 can round differently.
    max_batch_size: int | None = 1

    def record_step(self, proposed: int, accepted: int) -> None:
        """One target pass that verified ``proposed`` tokens and accepted ``accepted``."""
        self.num_target_passes += 1
        if not proposed:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (accepted - len(per_pos)))
        for i in range(accepted):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per speculative step: 1 + accepted / drafts (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def speculation(self) -> dict[str, FigureValue]:
        """The speculation figures (``SPECULATION_FIGURES``) by name, JSON-ready."""
        figures: dict[str, FigureValue] = {}
        for figure in SPECULATION_FIGURES:
            value = getattr(self, figure.name)
            figures[figure.name] = list(value) if isinstance(value, list) else value
        return figures

    def span_attributes(self) -> dict[str, FigureValue]:
        """The speculation figures as OpenTelemetry attributes ``specgate.speculative.*``."""
        return {f"specgate.speculative.{k}": v for k, v in self.speculation().items()}

    def add_counts(self, other: GenerationStats) -> None:
        """Add ``other``'s counted figures (``count`` and ``per_position``) to these."""
        for figure in SPECULATION_FIGURES:
            if figure.kind == "count":
                total = getattr(self, figure.name) + getattr(other, figure.name)
                setattr(self, figure.name, total)
            elif figure.kind == "per_position":
                mine, theirs = getattr(self, figure.name), getattr(other, figure.name)
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, count in enumerate(theirs):
                    mine[i] += count

    def as_dict(self) -> dict[str, object]:
        return {
            **self.speculation(),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "time_to_first_token_s": self.time_to_first_token_s,
            "total_time_s": self.total_time_s,
            "tokens_per_second": self.tokens_per_second,
            "replica": self.replica,
        }


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability under the target's processed distribution, with
    the ``top`` most likely tokens there (``(text, logprob)``, most likely first). ``text``
    is the token decoded alone; ``bytes`` its UTF-8 bytes as the tokenizer holds them."""

    token_id: int
    text: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[tuple[str, tuple[int, ...], float], ...] = ()


@dataclass(frozen=True)
class StreamDelta:
    """A piece of output. The last delta of a request carries ``finish_reason`` and ``stats``.
    ``logprobs`` (when asked for) has one entry per token in ``token_ids``."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class GenerationResult:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class FallbackEvent:
    """A speculation method was switched off (``disabled``) or back on (``enabled``).

    ``threshold`` is the method's acceptance threshold (None: it has none), ``cost_ratio``
    one proposed token's cost in plain target passes, ``speedup_estimate`` the speedup over
    plain decoding the window shows and ``min_speedup`` the margin it is held to (None where
    costs were not measured yet).
    """

    method: Method
    model: str
    action: Literal["disabled", "enabled"]
    reason: str
    acceptance_rate: float
    window_tokens: int
    threshold: float | None
    timestamp: float = field(default_factory=time.time)
    cost_ratio: float | None = None
    speedup_estimate: float | None = None
    min_speedup: float | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "method": self.method,
            "model": self.model,
            "action": self.action,
            "reason": self.reason,
            "acceptance_rate": self.acceptance_rate,
            "window_tokens": self.window_tokens,
            "threshold": self.threshold,
            "timestamp": self.timestamp,
            "cost_ratio": self.cost_ratio,
            "speedup_estimate": self.speedup_estimate,
            "min_speedup": self.min_speedup,
        }


class EngineError(Exception):
    """Base of the errors the engine raises on purpose."""


class InvalidRequestError(EngineError):
    """The request cannot be served as asked (the gateway answers 400); ``param`` names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """Prompt plus max_tokens do not fit the target's context window."""


class MethodUnavailableError(InvalidRequestError):
    """A request asked for a speculation method this engine has not loaded."""


class NoChatTemplateError(InvalidRequestError):
    """A chat request for a model whose tokenizer has no chat template."""


class QueueFullError(EngineError):
    """The bounded request queue is full (the gateway answers 429)."""


class EngineClosedError(EngineError):
    """The engine is shutting down and takes no more requests."""


class BackendUnavailableError(EngineError):
    """No replica of a remote backend can take the request now (the gateway answers 503)."""


class IncompatibleDraftError(EngineError):
    """The draft model's vocabulary does not match the target's."""
