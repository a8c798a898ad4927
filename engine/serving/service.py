"""The engine as a service: load models once, take requests from many callers through a
bounded queue, and serve them in turn on one worker thread that owns the KV caches.

One worker means no two requests can ever share or corrupt a cache; the queue bound turns
overload into an immediate ``QueueFullError`` instead of unbounded latency.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.api.types import (
    MAX_SPECULATIVE_TOKENS,
    MAX_TOP_LOGPROBS,
    CompiledConstraint,
    Constraint,
    EngineClosedError,
    FallbackEvent,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    InvalidRequestError,
    Method,
    MethodUnavailableError,
    PromptTooLongError,
    QueueFullError,
    SamplingParams,
)
from engine.config import EngineConfig, SpeculativeConfig
from engine.kernels import decode_attention, small_gemm
from engine.models.batched_cache import supports_batching
from engine.models.batched_runner import BatchedRunner
from engine.models.compat import continues_exactly
from engine.models.dtype_choice import DtypeChoice
from engine.models.loading import (
    choose_dtype,
    context_window,
    embedding_rows,
    load_model,
    load_tokenizer,
    pick_device,
)
from engine.models.model_runner import ModelRunner
from engine.models.packed_linear import pack_linear_weights
from engine.models.serial_runner import SerialRunner
from engine.models.versioning import model_version
from engine.serving.logprobs import LogprobRecorder
from engine.serving.output import OutputAssembler
from engine.serving.request_handle import RequestHandle
from engine.serving.scheduler import ActiveSequence, BatchLimits, BatchScheduler, reservation
from engine.serving.step import StepRunner
from engine.speculation import methods
from engine.speculation.adaptive import (
    FallbackMonitor,
    NodeHits,
    PassCosts,
    RunLengths,
    SpeculationLength,
    window_speedup,
)
from engine.speculation.batch_speculation import StepCosts, crossover
from engine.speculation.grammar import Grammars
from engine.speculation.logits_processors import LogitsProcessing
from engine.speculation.methods import PLAIN, LoadContext, LoadedMethod
from engine.speculation.proposers import Proposer
from engine.speculation.proposers.base import ShapeAdapting
from engine.speculation.request import Speculation
from engine.speculation.sampling import effective_sampling

_tracer = trace.get_tracer("specgate.engine")

# K for seeded sampling requests that leave it open: adaptive K depends on timing and on
# other requests, so a seeded request pins its method and K to stay reproducible.
SEEDED_DEFAULT_K = 4
# Each step shrinks the weight of older steps in the engine-wide run lengths: about the last
# 200 steps (a handful of requests) count.
HISTORY_DECAY = 0.995
# Load-time calibration times every target pass width up to this many rows (a 16-node
# proposal's), and every fourth width beyond it: a pass's cost grows smoothly with its rows.
DENSE_CALIBRATION_ROWS = 17

FallbackListener = Callable[[FallbackEvent], None]


@dataclass(frozen=True)
class _Plan:
    speculation: Speculation | None
    method: Method
    fallback_active: bool


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        target_version: str,
        on_fallback: FallbackListener | None = None,
        dtype_choice: DtypeChoice | None = None,
    ) -> None:
        """Serve ``target``; every registered speculation method the configuration provides
        for (``engine.speculation.methods``) loads its artefacts here. ``dtype_choice``: how the
        target's dtype was chosen (``Engine.load``); by default, the caller's as loaded."""
        self.config = config
        self.dtype_choice = dtype_choice or DtypeChoice(
            config.dtype, target.dtype, "the caller's model as loaded"
        )
        self.speculative_config: SpeculativeConfig = config.speculative
        self.tokenizer = tokenizer
        self.model_name = config.served_model_name or config.target.name
        self.target_version = target_version
        self.max_context = context_window(target.config)
        self.vocab_size = embedding_rows(target)
        self.device = target.device
        self.target_dtype = target.dtype
        # On CPU: oneDNN-prepacked weights (engine.models.packed_linear).
        pack_linear_weights(target)
        self._target = ModelRunner(target)
        # False where the target cannot verify several tokens in one pass (engine.models.compat):
        # then no speculation method is offered (and none loads its artefacts).
        self.can_speculate = continues_exactly(self._target, self.vocab_size)
        # Continuous batching where every attention layer is plain full attention; other
        # models (sliding-window, chunked, recurrent layers) are served one request at a time.
        batching = supports_batching(target.config)
        self._batching_blocked_by = (
            None if batching else "sliding-window, chunked or recurrent layers"
        )
        spec = config.speculative
        self._costs = PassCosts()
        self._methods: dict[Method, LoadedMethod] = (
            _load_methods(
                LoadContext(
                    config, target, self._target, tokenizer, target_version, self.vocab_size,
                    self._costs,
                )
            )
            if self.can_speculate
            else {}
        )
        # Every versioned artefact speculation loaded besides the target, for the audit log.
        self.artefacts: tuple[dict[str, str | None], ...] = tuple(
            artefact.as_dict()
            for loaded in self._methods.values()
            for artefact in loaded.artefacts
        )
        # One proposer per request: a draft proposer keeps its own draft cache, and requests
        # in one batch draft side by side (the n-gram proposer has no state to share).
        self._new_proposer: dict[Method, Callable[[], Proposer]] = {
            method: loaded.new_proposer for method, loaded in self._methods.items()
        }
        self._proposers: dict[Method, Proposer] = {
            method: make() for method, make in self._new_proposer.items()
        }
        # And one request at a time where a method says its requests cannot share a batch.
        for loaded in self._methods.values():
            if self._batching_blocked_by is None:
                self._batching_blocked_by = loaded.batching_blocked_by
        self.batching = self._batching_blocked_by is None
        self._runner: StepRunner = (
            BatchedRunner(target, config.max_num_seqs, config.batch_invariant)
            if self.batching
            else SerialRunner(self._target)
        )
        self.available_methods: tuple[Method, ...] = (PLAIN, *self._proposers)
        self._eos = _eos_ids(target, tokenizer)
        self.grammars = Grammars(tokenizer, self.vocab_size, self._eos)
        threading.Thread(target=self.grammars.prepare, name="specgate-grammar", daemon=True).start()
        self._listener = on_fallback
        self._load_shedding = False
        self._step_costs = StepCosts(self._costs)
        self._monitor = FallbackMonitor(
            self.model_name,
            {method: spec.acceptance_threshold_for(method) for method in self._proposers},
            spec.min_speedup,
            spec.window_tokens,
            spec.probe_interval_requests,
            self._costs,
            on_fallback,
        )
        # Engine-wide accepted-run lengths per method, the prior of each request's adaptive k;
        # only the worker thread touches them.
        self._run_lengths: dict[Method, RunLengths | NodeHits] = {
            method: (NodeHits if proposer.proposes_trees else RunLengths)(
                self._max_k(method), decay=HISTORY_DECAY
            )
            for method, proposer in self._proposers.items()
        }
        self._calibrate()
        self._queue: queue.Queue[RequestHandle | None] = queue.Queue(maxsize=config.max_queue)
        self._closed = False
        self._scheduler: BatchScheduler | None = None
        self._worker = threading.Thread(target=self._serve, name="specgate-engine", daemon=True)
        self._worker.start()

    @classmethod
    def load(cls, config: EngineConfig, on_fallback: FallbackListener | None = None) -> Engine:
        """Load the target (and each method's artefacts) from local directories and start
        the worker."""
        device = pick_device(config.device)
        if device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        tokenizer = load_tokenizer(config.target)
        choice = choose_dtype(config.target, device, config.dtype)
        target = load_model(config.target, device, config.dtype)
        version = model_version(config.target)
        return cls(config, target, tokenizer, version, on_fallback, choice)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a place in the running batch (or, served one at a time, for
        their turn)."""
        waiting = len(self._scheduler.waiting) if self._scheduler is not None else 0
        return self._queue.qsize() + waiting

    @property
    def closed(self) -> bool:
        """Shut down, or its worker thread is gone: it answers no more requests."""
        return self._closed or not self._worker.is_alive()

    @property
    def batching_mode(self) -> str:
        """How requests share the target, for the startup event."""
        if self.batching:
            invariant = ", batch-invariant" if self.config.batch_invariant else ""
            attention = (
                f", decode attention: {decode_attention.status()}"
                f", small products: {small_gemm.status()}"
                if self.device.type == "cpu" else ""
            )
            return f"continuous (max_num_seqs={self.config.max_num_seqs}{invariant}{attention})"
        return f"one request at a time ({self._batching_blocked_by})"

    def _fixed_proposer(self, method: Method) -> Proposer:
        """A proposer for a fixed k, a seeded request or a replay: its proposals' shape does
        not follow measured costs (engine.speculation.proposers.base.ShapeAdapting)."""
        proposer = self._new_proposer[method]()
        if isinstance(proposer, ShapeAdapting):
            proposer.fix_shape()
        return proposer

    def new_proposer(self, method: Method) -> Proposer:
        """A fresh proposer of a loaded method, configured as requests get it."""
        return self._new_proposer[method]()

    def speculation_crossover(self, method: Method) -> float:
        """The smallest batch size at which a batch of new requests with the method chooses
        plain steps (k = 0) from the measured step costs and the method's current acceptance
        (``engine.speculation.batch_speculation.crossover``, the same choice every step makes); inf
        where speculating pays up to ``max_num_seqs``; 0 for a method that is not loaded."""
        if method not in self._proposers:
            return 0.0
        fresh = SpeculationLength(
            self._max_k(method),
            self._monitor.prior(method),
            self._costs,
            method,
            self._run_lengths[method],
        )
        return crossover(self._step_costs, fresh, self.config.max_num_seqs)

    def estimated_speedup(
        self, method: Method, drafted: int, accepted: int, drafts: int, passes: int
    ) -> float | None:
        """The speedup over plain decoding of requests with these figures (``drafted`` tokens
        proposed in ``drafts`` of ``passes`` target passes, ``accepted`` kept), at this
        engine's measured pass costs: the estimate the fallback judges a method's window by
        (``engine.speculation.adaptive.window_speedup``), for figures counted elsewhere (the
        gateway's per-workload windows). None before the costs are measured."""
        estimate = window_speedup(self._costs, method, drafted, accepted, drafts, passes)
        return None if estimate is None else estimate[1]

    def fallback_state(self) -> dict[Method, bool]:
        """Per method: whether the engine has stopped proposing with it, switched off by
        fallback or left idle by adaptive k."""
        disabled = self._monitor.disabled_methods() | self._monitor.idle_methods()
        return {method: method in disabled for method in self._proposers}

    def submit(self, request: GenerationRequest) -> RequestHandle:
        if self._closed:
            raise EngineClosedError("engine is shut down")
        self._validate(request)
        # Applied once here, so the target's and the proposers' sides see the same values.
        request = replace(request, sampling=effective_sampling(request.sampling))
        constraint = request.sampling.constraint
        compiled = request.compiled
        if constraint is None:
            grammar = None
        elif compiled is not None and compiled.constraint == constraint:
            grammar = compiled.grammar
        else:
            grammar = self.grammars.compile(constraint)
        handle = RequestHandle(request, time.perf_counter(), grammar)
        try:
            self._queue.put_nowait(handle)
        except queue.Full:
            raise QueueFullError(
                f"request queue is full ({self.config.max_queue} waiting); retry later"
            ) from None
        return handle

    def compile_constraint(self, constraint: Constraint) -> CompiledConstraint:
        """``constraint``'s grammar for this tokenizer; InvalidRequestError when it has none
        (CPU work, and the first call may wait for the token table: not on an event loop)."""
        return CompiledConstraint(constraint, self.grammars.compile(constraint))

    def generate(self, request: GenerationRequest) -> GenerationResult:
        return self.submit(request).result()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._worker.join(timeout=30)

    def _validate(self, request: GenerationRequest) -> None:
        params = request.sampling
        if not request.prompt_ids:
            raise InvalidRequestError("prompt must contain at least one token", "prompt")
        if any(not 0 <= t < self.vocab_size for t in request.prompt_ids):
            raise InvalidRequestError(
                f"prompt token ids must lie in [0, {self.vocab_size})", "prompt"
            )
        if params.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", "max_tokens")
        if params.temperature < 0:
            raise InvalidRequestError("temperature must not be negative", "temperature")
        if not 0.0 < params.top_p <= 1.0:
            raise InvalidRequestError("top_p must lie in (0, 1]", "top_p")
        if params.top_k < 0:
            raise InvalidRequestError("top_k must not be negative", "top_k")
        _validate_processors(params, self.vocab_size)
        needed = len(request.prompt_ids) + params.max_tokens
        if needed > self.max_context:
            raise PromptTooLongError(
                f"this model's context window is {self.max_context} tokens; the prompt has "
                f"{len(request.prompt_ids)} tokens and max_tokens asks for {params.max_tokens}",
                "messages",
            )
        choice = request.speculative
        if choice.method is not None and choice.method not in self.available_methods:
            raise MethodUnavailableError(
                f"speculative method {choice.method!r} is not loaded; available: "
                f"{', '.join(self.available_methods)}",
                "speculative",
            )
        k = choice.num_speculative_tokens
        if k is not None and not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequestError(
                f"num_speculative_tokens must lie in [1, {MAX_SPECULATIVE_TOKENS}]",
                "speculative.num_speculative_tokens",
            )

    def _serve(self) -> None:
        """Every request through the scheduler's step: in a shared batch, or one at a time
        where the model's cache slots cannot share a pass (its prompt prefilled whole, as
        Hugging Face's cache of such layers takes it)."""
        config = self.config
        if self.batching:
            limits = BatchLimits(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.max_kv_tokens,
                config.long_prefill_token_threshold,
                config.batch_invariant,
                config.max_prefill_chunk_seconds,
            )
        else:
            whole = max(self.max_context, config.max_num_batched_tokens)
            limits = BatchLimits(1, whole, None, whole)
        self._scheduler = BatchScheduler(
            self._runner, limits, self._costs, self._step_costs, self._admit, self._finish
        )
        self._scheduler.run(self._queue)

    @property
    def target_model(self) -> PreTrainedModel:
        """The target model (for recomputing logits, as ``engine.speculation.divergence`` does)."""
        return self._target.model

    def _plan(self, request: GenerationRequest) -> _Plan:
        spec = self.speculative_config
        method: Method = request.speculative.method or spec.method
        if method == "none":
            return _Plan(None, "none", False)
        if method not in self._proposers:  # the default method, on a model that cannot verify
            return _Plan(None, method, True)
        params = request.sampling
        schedule = request.speculative.schedule
        if schedule is not None:  # a replay: exactly the recorded proposal lengths
            length = SpeculationLength(
                self._max_k(method), 0.0, self._costs, method, self._run_lengths[method]
            )
            proposer = self._fixed_proposer(method)
            return _Plan(Speculation(proposer, None, length, 0.0, schedule), method, False)
        pinned = not params.greedy and params.seed is not None and not params.seed_drawn
        fixed_k = request.speculative.num_speculative_tokens or spec.num_speculative_tokens
        if pinned:
            fixed_k = fixed_k or SEEDED_DEFAULT_K
        elif self._shed_load() or not self._monitor.admit(method):
            return _Plan(None, method, True)
        prior = self._monitor.prior(method)
        length = SpeculationLength(
            self._max_k(method), prior, self._costs, method, self._run_lengths[method]
        )
        confidence = spec.draft_confidence_threshold if fixed_k is None else 0.0
        proposer = self._new_proposer[method]() if fixed_k is None else self._fixed_proposer(method)
        speculation = Speculation(proposer, fixed_k, length, confidence)
        return _Plan(speculation, method, False)

    def _max_k(self, method: Method) -> int:
        """The most a proposal of ``method`` may hold: ``max_speculative_tokens``, and no
        more than its proposer can propose (``Proposer.most_tokens``)."""
        limit = self.speculative_config.max_speculative_tokens
        most = self._proposers[method].most_tokens
        return limit if most is None else min(limit, most)

    def _calibrate(self, repeats: int = 3) -> None:
        """Time target passes of 1 to max_k + 1 tokens (every size up to
        ``DENSE_CALIBRATION_ROWS``, every fourth beyond it and the widest, the rest
        interpolated: ``PassCosts.target``), and each model-based proposer's pass
        (``LoadedMethod.calibrate``), once at load, so that
        adaptive k starts from this machine's real costs (refined by every pass served)."""
        max_k = self.speculative_config.max_speculative_tokens
        # A batched step of an unmeasured number of rows takes the shape of one pass of as
        # many (engine.speculation.batch_speculation.StepCosts): beyond one request's k + 1 rows,
        # sizes up to a full batch of k + 1 rows each.
        dense = min(max_k + 1, DENSE_CALIBRATION_ROWS)
        sizes = sorted({*range(1, dense + 1), *range(dense + 4, max_k + 2, 4), max_k + 1})
        batch_rows = self.config.max_num_seqs * (max_k + 1)
        sizes += [n for n in (32, 64, 128) if max_k + 1 < n <= batch_rows]
        sizes = [n for n in sizes if n == 1 or 32 + n <= self.max_context]
        prompt = [3 + i % max(1, self.vocab_size - 3) for i in range(32 + max(sizes))]

        def seconds(runner: ModelRunner, tokens: list[int]) -> float:
            times = []
            for _ in range(repeats + 1):  # the first pass warms up
                length = runner.length
                started = time.perf_counter()
                runner.forward(tokens).sum().item()
                times.append(time.perf_counter() - started)
                runner.truncate(length)
            return min(times[1:])  # noise on shared cores only ever adds time

        self._target.prefill(prompt[:32])
        for tokens in sizes:
            self._costs.record_target(tokens, seconds(self._target, prompt[32 : 32 + tokens]))
        for method, loaded in self._methods.items():
            proposer = self._proposers[method]
            runner = None if loaded.calibrate is None else loaded.calibrate(proposer)
            if runner is not None:
                runner.prefill(prompt[:32])
                self._costs.record_proposer(method, seconds(runner, prompt[-1:]))
                proposer.start([])

    def _shed_load(self) -> bool:
        """Step down to plain decoding while too many requests wait (vLLM's batch-size rule)."""
        limit = self.speculative_config.disable_by_queue_depth
        if limit is None:
            return False
        depth = self.queue_depth
        shedding = depth >= limit
        if shedding != self._load_shedding:
            self._load_shedding = shedding
            if self._listener is not None:
                method = self.speculative_config.method
                rate, tokens = self._monitor.rate(method)
                self._listener(
                    FallbackEvent(
                        method=method,
                        model=self.model_name,
                        action="disabled" if shedding else "enabled",
                        reason=f"queue depth {depth} {'>=' if shedding else '<'} limit {limit}",
                        acceptance_rate=rate,
                        window_tokens=tokens,
                        threshold=self._monitor.threshold(method),
                    )
                )
        return shedding

    def _record(self, speculation: Speculation | None, stats: GenerationStats) -> None:
        """A finished request's acceptance and passes, into the fallback monitor."""
        if speculation is not None:
            adaptive = speculation.fixed_k is None
            self._monitor.record(
                stats.method,
                stats.num_draft_tokens,
                stats.num_accepted_tokens,
                passes=stats.num_drafts,
                steps=stats.num_target_passes,
                plain_steps=speculation.length.plain_steps if adaptive else 0,
            )

    def _processing(self, handle: RequestHandle) -> LogitsProcessing | None:
        """The request's logits processors (penalties, bias, grammar), or None without any."""
        params = handle.request.sampling
        if not params.processes_logits:
            return None
        return LogitsProcessing(
            params,
            list(handle.request.prompt_ids),
            self.vocab_size,
            frozenset() if params.ignore_eos else self._eos,
            self.device,
            None if handle.grammar is None else self.grammars.matcher(handle.grammar),
            eos_ids=self._eos,
        )

    def _recorder(self, params: SamplingParams) -> LogprobRecorder | None:
        return None if params.logprobs is None else LogprobRecorder(self.tokenizer, params.logprobs)

    def _admit(self, handle: RequestHandle) -> ActiveSequence:
        """A request joining the running batch: its plan, generator and output."""
        request = handle.request
        params = request.sampling
        token = otel_context.attach(handle.otel_context)
        try:
            plan = self._plan(request)
        finally:
            otel_context.detach(token)
        stats = GenerationStats(
            method=plan.method,
            num_prompt_tokens=len(request.prompt_ids),
            fallback_active=plan.fallback_active,
        )
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        prompt = list(request.prompt_ids)
        return ActiveSequence(
            handle=handle,
            method=plan.method,
            speculation=plan.speculation,
            stats=stats,
            generator=torch.Generator(device=self.device).manual_seed(seed),
            output=OutputAssembler(self.tokenizer, params, prompt, self._eos),
            context=list(prompt),
            reserved=reservation(len(prompt), params.max_tokens),
            remaining=params.max_tokens,
            processing=self._processing(handle),
            recorder=self._recorder(params),
        )

    def _finish(self, seq: ActiveSequence) -> None:
        self._record(seq.speculation, seq.stats)


def _validate_processors(params: SamplingParams, vocab_size: int) -> None:
    """The logits processors' ranges (OpenAI's, and vLLM's for its extensions)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(params, name) <= 2.0:
            raise InvalidRequestError(f"{name} must lie in [-2, 2]", name)
    if not 0.0 < params.repetition_penalty <= 2.0:
        raise InvalidRequestError("repetition_penalty must lie in (0, 2]", "repetition_penalty")
    for token, bias in params.logit_bias:
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"logit_bias token ids must lie in [0, {vocab_size})", "logit_bias"
            )
        if not -100.0 <= bias <= 100.0:
            raise InvalidRequestError("logit_bias values must lie in [-100, 100]", "logit_bias")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise InvalidRequestError("min_tokens must lie in [0, max_tokens]", "min_tokens")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(
            f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs"
        )


def _load_methods(context: LoadContext) -> dict[Method, LoadedMethod]:
    """Every registered method the configuration provides for: those that load nothing, and
    those whose artefact directory is given and is theirs (``MethodSpec.recognises``; the
    configured default method always loads, so that a wrong directory is an error)."""
    loaded: dict[Method, LoadedMethod] = {}
    default = context.config.speculative.method
    for name, spec in methods.methods().items():
        if spec.load is None:
            continue
        directory = context.artefact_dir(spec)
        if spec.artefact is not None and (
            directory is None
            or (spec.recognises is not None and not spec.recognises(directory) and name != default)
        ):
            continue
        loaded[name] = spec.load(context)
    return loaded


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    generation = getattr(model, "generation_config", None)
    configured = getattr(generation, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
