"""vLLM OpenAI-compatible servers as a ``GenerationBackend``.

The gateway keeps doing what it does for the built-in engine (auth, templating checks, the
`request`/`completion` events, the OpenAI wire format); vLLM generates. Chat prompts are
rendered and tokenized by the server itself (``/tokenize``), so the token ids the gateway
records and sends are exactly those vLLM's own chat endpoint would use, with no second copy
of the template to drift from the server's. The prompt's text (for the `request` event's
commitment) is the server's ``/detokenize`` of those ids, or the same decode done by the
model's tokenizer beside the gateway where a ``model_dir`` gives it and a start-up probe shows
it answering as the server does (``gateway.backends.vllm_tokenizer``): one round trip before
generation instead of two, none for a completion prompt. Generation goes to
``/v1/completions`` with those ids (``gateway.backends.vllm_wire``).

Routing: replicas form a ``speculative`` and a ``plain`` pool; a request goes to the least
loaded healthy replica of its pool (``gateway.backends.vllm_replicas``). ``speculative:
false``, and every request while the rolling acceptance monitor (``engine.speculation.adaptive``)
has switched speculation off, goes to the plain pool (probes excepted); with no healthy replica in
its pool a speculating request falls over to the other pool (the output is the same,
speculation being lossless). All network work runs on the backend's own event-loop thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import structlog

from engine.api.chat import DEFAULT_TEMPLATE, TemplateOptions
from engine.api.delta_channel import DeltaChannel
from engine.api.grammar_text import checked_grammar
from engine.api.types import (
    BackendUnavailableError,
    CompiledConstraint,
    Constraint,
    EngineError,
    FallbackEvent,
    FinishReason,
    GenerationRequest,
    GenerationStats,
    InvalidRequestError,
    Method,
    MethodUnavailableError,
    NoChatTemplateError,
    StreamDelta,
)
from engine.models.versioning import read_manifest
from engine.speculation import methods
from engine.speculation.adaptive import FallbackMonitor, PassCosts
from gateway.backends.base import BackendCard, BackendHealth
from gateway.backends.vllm_acceptance import IntervalAttribution, request_figures
from gateway.backends.vllm_chat import template_renders_tools, tokenize_chat_body
from gateway.backends.vllm_replica_check import (
    CheckHistory,
    Expected,
    ReplicaCheck,
    read_metrics,
    read_served,
)
from gateway.backends.vllm_replicas import Pool, Replica, ReplicaEvent, Replicas
from gateway.backends.vllm_tokenizer import LocalTokenizer, disagreement
from gateway.backends.vllm_wire import (
    WireError,
    accepted_per_position,
    completion_body,
    parse_event,
    spec_counters,
    trace_headers,
)
from gateway.settings import ConfigError, Settings

log = structlog.get_logger(__name__)
T = TypeVar("T")

# vocab_size for the card when no model_dir names the config: vLLM checks prompt ids itself.
_UNKNOWN_VOCAB = 2**31 - 1

ReplicaNews = ReplicaEvent | ReplicaCheck
ReplicaListener = Callable[[ReplicaNews], None]


def specgate_method(vllm_config: dict[str, Any]) -> Method:
    """vLLM's speculative method as Specgate names it (``engine.speculation.methods``); one Specgate
    does not implement (EAGLE, MTP, ...) runs a model, so it counts as ``draft``."""
    registered = methods.from_vllm_name(str(vllm_config.get("method")))
    return registered.name if registered is not None else "draft"


def served_artefacts(vllm_config: Mapping[str, Any] | None) -> tuple[dict[str, str | None], ...]:
    """The versioned artefact a speculative server loads besides the target (its config's
    ``model``: a draft model, heads), by the kind the method's registration gives it, versioned
    by the ``specgate models hash`` manifest beside its weights; empty for n-gram.

    The gateway cannot hash weights on the server, so it reads the manifest at the path the
    server was given: that directory must be visible to the gateway (a shared volume), as the
    target's ``model_dir`` is. Without a manifest the gateway refuses to start, since records
    naming an unversioned draft could not show what produced an answer."""
    model = vllm_config.get("model") if vllm_config else None
    if not model:
        return ()
    assert vllm_config is not None
    registered = methods.spec(specgate_method(dict(vllm_config)))
    kind = registered.artefact.kind if registered.artefact is not None else "draft_model"
    try:
        version = read_manifest(Path(str(model)))
    except ValueError as error:
        raise ConfigError(f"backend.vllm_servers speculative_config.model: {error}") from None
    return ({"kind": kind, "name": Path(str(model)).name, "version": version},)


class _StatusError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class _MidStreamError(Exception):
    """The replica failed after the first piece: the request cannot be retried elsewhere."""


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(body.get("message", body) if isinstance(body, dict) else body)[:500]


def served_version(settings: Settings) -> str:
    """The one model version every server serves (operator-given or from its manifest)."""
    found = set()
    for index, server in enumerate(settings.backend.vllm_servers):
        if server.model_version is not None:
            found.add(server.model_version)
            continue
        assert server.model_dir is not None  # the settings validator saw to it
        try:
            found.add(read_manifest(server.model_dir))
        except ValueError as error:
            raise ConfigError(f"backend.vllm_servers[{index}].model_dir: {error}") from None
    if len(found) != 1:
        raise ConfigError(f"backend.vllm_servers: servers name different model versions {found}")
    return found.pop()


def served_vocab_size(settings: Settings) -> int:
    for server in settings.backend.vllm_servers:
        if server.model_dir is not None:
            try:
                config = json.loads((server.model_dir / "config.json").read_text())
                return int(config["vocab_size"])
            except (OSError, ValueError, KeyError):
                continue
    return _UNKNOWN_VOCAB


class VllmBackend:
    """Serves from vLLM servers; see the module docstring for routing and records."""

    def __init__(
        self, settings: Settings, on_fallback: Callable[[FallbackEvent], None] | None
    ) -> None:
        self._settings = settings
        config = settings.backend
        self._config = config
        self._replicas = Replicas(
            Replica(s.url.rstrip("/"), s.resolved_pool, s.speculative_config)
            for s in config.vllm_servers
        )
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        self._sync = httpx.Client(timeout=timeout)
        self._pending_events: list[ReplicaNews] = []
        self._replica_listener: ReplicaListener | None = None
        self._events_lock = threading.Lock()
        self._vllm_name, max_context = self._discover(settings)
        self._checks = CheckHistory()
        # Per replica URL: its start time (from /metrics) and the /v1/models and /version
        # bodies read since it started.
        self._identities: dict[str, tuple[str | None, Any, Any]] = {}
        self._card = self._make_card(settings, max_context)
        self._tokenizer = self._checked_tokenizer(settings)
        self._renders_tools: bool | None = None
        try:
            self._template_renders_tools()
        except EngineError as error:
            log.warning("vllm_template_probe_deferred", reason=str(error))
        self._spec_method: Method | None = next(
            (m for m in self._card.available_methods if m != "none"), None
        )
        thresholds: dict[Method, float | None] = {}
        if self._spec_method is not None:
            # No pass costs are measured through HTTP, so the speedup rule cannot apply: every
            # method is judged on acceptance (its own threshold, else the default).
            thresholds[self._spec_method] = settings.acceptance_thresholds.get(
                self._spec_method, settings.acceptance_threshold
            )
        self._monitor = FallbackMonitor(
            self._card.model_name,
            thresholds,
            0.0,
            settings.fallback_window_tokens,
            settings.fallback_probe_interval,
            PassCosts(),
            on_fallback,
        )
        self._attribution = {
            id(r): IntervalAttribution() for r in self._replicas.all if r.pool == "speculative"
        }
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="vllm-backend", daemon=True)
        self._thread.start()
        self._client: httpx.AsyncClient = self._call(self._open_client(timeout))
        self._tasks = self._call(self._start_watchers())

    @classmethod
    def load(
        cls, settings: Settings, on_fallback: Callable[[FallbackEvent], None] | None = None
    ) -> VllmBackend:
        return cls(settings, on_fallback)

    # -- start-up -------------------------------------------------------------------------

    def _discover(self, settings: Settings) -> tuple[str, int]:
        """The served model name and context length, from each server's ``/v1/models``;
        a server that does not answer starts out of rotation (and is retried)."""
        names: set[str] = set()
        contexts: set[int] = set()
        for replica, server in zip(self._replicas.all, settings.backend.vllm_servers, strict=True):
            try:
                response = self._sync.get(f"{replica.url}/v1/models")
                response.raise_for_status()
                models = response.json()["data"]
            except (httpx.HTTPError, ValueError, KeyError) as error:
                self._emit(replica.take_out(f"not reachable at start-up: {error}"))
                continue
            wanted = server.served_model_name
            entry = next((m for m in models if wanted in (None, m["id"])), None)
            if entry is None:
                listed = [m["id"] for m in models]
                raise ConfigError(
                    f"backend.vllm_servers: {replica.url} serves {listed}, not {wanted!r}"
                )
            names.add(str(entry["id"]))
            if entry.get("max_model_len"):
                contexts.add(int(entry["max_model_len"]))
        if not names:
            raise ConfigError("backend.vllm_servers: no vLLM server answered at start-up")
        if len(names) > 1:
            raise ConfigError(f"backend.vllm_servers: servers serve different models {names}")
        return names.pop(), min(contexts) if contexts else 2048

    def _make_card(self, settings: Settings, max_context: int) -> BackendCard:
        speculative = next(
            (r.speculative_config for r in self._replicas.all if r.pool == "speculative"), None
        )
        served: list[Method] = []
        if self._replicas.has("plain"):
            served.append("none")
        spec_method = specgate_method(speculative) if speculative else None
        if spec_method is not None:
            served.append(spec_method)
        k = speculative.get("num_speculative_tokens") if speculative else None
        default = spec_method or "none"
        if settings.method == "none":  # speculation off by default (`tune apply` may set it)
            if not self._replicas.has("plain"):
                raise ConfigError("method: 'none' needs a server in the plain pool")
            default, k = "none", None
        return BackendCard(
            model_name=settings.served_model_name or self._vllm_name,
            target_version=served_version(settings),
            max_context=max_context,
            vocab_size=served_vocab_size(settings),
            available_methods=tuple(served),
            speculative_config=dict(speculative) if speculative else {},
            default_method=default,
            default_num_speculative_tokens=int(k) if isinstance(k, int) else None,
            artefacts=served_artefacts(speculative),
        )

    def _checked_tokenizer(self, settings: Settings) -> LocalTokenizer | None:
        """The tokenizer beside the first ``model_dir``, where it answers the probe as a
        server does (``gateway.backends.vllm_tokenizer``); else None: ask the server."""
        model_dir = next((s.model_dir for s in settings.backend.vllm_servers if s.model_dir), None)
        local = LocalTokenizer.load(model_dir) if model_dir is not None else None
        if local is None:
            return None
        try:
            problem = disagreement(local, self._server_tokenize, self._server_detokenize)
        except EngineError as error:
            problem = f"the probe failed: {error}"
        if problem is not None:
            log.warning("vllm_local_tokenizer_not_used", model_dir=str(model_dir), reason=problem)
            return None
        return local

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _open_client(self, timeout: httpx.Timeout) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        return httpx.AsyncClient(timeout=timeout, limits=limits)

    async def _start_watchers(self) -> list[asyncio.Task[None]]:
        """Admission (each replica's health and configuration checked once), then the
        watchers."""
        await asyncio.gather(*(self._check(replica) for replica in self._replicas.all))
        tasks = [asyncio.create_task(self._watch_health(r)) for r in self._replicas.all]
        tasks += [
            asyncio.create_task(self._scrape_counters(r))
            for r in self._replicas.all
            if id(r) in self._attribution
        ]
        return tasks

    # -- replica health -------------------------------------------------------------------

    def watch_replicas(self, listener: ReplicaListener) -> None:
        """Report every replica change to ``listener`` (the audit and the metrics), those
        since start-up first."""
        with self._events_lock:
            self._replica_listener = listener
            pending, self._pending_events = self._pending_events, []
        for event in pending:
            listener(event)

    def replica_states(self) -> list[tuple[str, Pool, bool, int]]:
        """(url, pool, in rotation, requests in flight) per replica, for the metrics."""
        return [(r.url, r.pool, r.healthy, r.outstanding) for r in self._replicas.all]

    def _emit(self, event: ReplicaNews | None) -> None:
        if event is None:
            return
        log.warning(event.kind, **event.as_dict())
        with self._events_lock:
            listener = self._replica_listener
            if listener is None:
                self._pending_events.append(event)
                return
        listener(event)

    async def _watch_health(self, replica: Replica) -> None:
        config = self._config
        while True:
            await asyncio.sleep(
                config.health_interval_s if replica.healthy else config.retry_interval_s
            )
            await self._check(replica)

    async def _check(self, replica: Replica) -> None:
        """Health, then configuration: in rotation only a replica that answers both."""
        try:
            response = await self._client.get(
                f"{replica.url}/health", timeout=self._config.connect_timeout_s
            )
            problem = None if response.status_code == 200 else f"HTTP {response.status_code}"
        except httpx.HTTPError as error:
            problem = f"health check failed: {type(error).__name__}: {error}"
        if problem is None:
            problem = await self._configuration_problem(replica)
        if problem is None:
            self._emit(replica.put_back())
        else:
            self._emit(replica.take_out(problem))

    async def _configuration_problem(self, replica: Replica) -> str | None:
        """What the replica serves, from vLLM's own endpoints, against its pool's
        configuration (``gateway.backends.vllm_replica_check``): ``/metrics`` on every
        health check (a restart can come and go between two, or a Service switch pods),
        ``/v1/models`` and ``/version`` at admission and when ``/metrics`` shows a restart."""
        timeout = self._config.connect_timeout_s
        try:
            page = await self._client.get(f"{replica.url}/metrics", timeout=timeout)
            page.raise_for_status()
            metrics = read_metrics(page.text)
            identity = self._identities.get(replica.url)
            if identity is None or metrics.started is None or identity[0] != metrics.started:
                models, version = await asyncio.gather(
                    self._client.get(f"{replica.url}/v1/models", timeout=timeout),
                    self._client.get(f"{replica.url}/version", timeout=timeout),
                )
                models.raise_for_status()
                answered = version.json() if version.status_code == 200 else None
                identity = (metrics.started, models.json(), answered)
                self._identities[replica.url] = identity
            served = read_served(identity[1], identity[2], metrics)
        except (httpx.HTTPError, ValueError) as error:
            return f"configuration check failed: {type(error).__name__}: {error}"
        expected = Expected.for_replica(
            self._vllm_name, self._card.max_context, replica.pool, replica.speculative_config
        )
        found, news = self._checks.judge(replica.url, replica.pool, expected, served)
        self._emit(news)
        return f"serves another configuration: {'; '.join(found)}" if found else None

    async def _scrape_counters(self, replica: Replica) -> None:
        attribution = self._attribution[id(replica)]
        first = True
        while True:
            if first or attribution.waiting:
                try:
                    response = await self._client.get(
                        f"{replica.url}/metrics", timeout=self._config.connect_timeout_s
                    )
                    response.raise_for_status()
                    attribution.settle(
                        spec_counters(response.text), accepted_per_position(response.text)
                    )
                except httpx.HTTPError:
                    attribution.settle(None)
                first = False
            await asyncio.sleep(self._config.metrics_interval_s)

    # -- GenerationBackend ----------------------------------------------------------------

    @property
    def card(self) -> BackendCard:
        return self._card

    def _post_sync(self, path: str, body: dict[str, Any]) -> Any:
        replica = self._replicas.any_healthy()
        if replica is None:
            raise BackendUnavailableError("no vLLM replica is up to tokenize the prompt")
        try:
            response = self._sync.post(f"{replica.url}{path}", json=body, headers=trace_headers())
        except httpx.HTTPError as error:
            reason = f"{path} failed: {type(error).__name__}: {error}"
            # Replica state changes on the backend's loop only.
            self._loop.call_soon_threadsafe(lambda: self._emit(replica.take_out(reason)))
            raise BackendUnavailableError(f"vLLM replica {replica.url} did not answer") from None
        if response.status_code == 400:
            message = _error_message(response)
            if "chat template" in message.lower():
                raise NoChatTemplateError(message, param="messages")
            raise InvalidRequestError(message)
        if response.status_code != 200:
            raise BackendUnavailableError(
                f"vLLM replica {replica.url} answered {response.status_code} to {path}"
            )
        return response.json()

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: TemplateOptions = DEFAULT_TEMPLATE,
    ) -> tuple[str, tuple[int, ...]]:
        body = tokenize_chat_body(messages, tools, options, self._template_renders_tools())
        tokens = self._tokenize_chat(body)
        if self._tokenizer is not None:
            return self._tokenizer.decode(tokens), tokens
        return self._server_detokenize(tokens), tokens

    def _tokenize_chat(self, body: dict[str, Any]) -> tuple[int, ...]:
        reply = self._post_sync("/tokenize", {"model": self._vllm_name, **body})
        return tuple(int(t) for t in reply["tokens"])

    def _template_renders_tools(self) -> bool:
        """Whether the servers' chat template renders tools (``gateway.backends.vllm_chat``),
        asked once: at start-up, or at the first chat if no server answered then."""
        if self._renders_tools is None:
            self._renders_tools = template_renders_tools(self._tokenize_chat)
        return self._renders_tools

    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        if self._tokenizer is not None:
            return self._tokenizer.encode(text, add_special_tokens)
        return self._server_tokenize(text, add_special_tokens)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        if self._tokenizer is not None:
            return self._tokenizer.decode(token_ids)
        return self._server_detokenize(token_ids)

    def _server_tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        body = {"model": self._vllm_name, "prompt": text, "add_special_tokens": add_special_tokens}
        return tuple(int(t) for t in self._post_sync("/tokenize", body)["tokens"])

    def _server_detokenize(self, tokens: Sequence[int]) -> str:
        body = {"model": self._vllm_name, "tokens": list(tokens)}
        return str(self._post_sync("/detokenize", body)["prompt"])

    def compile_constraint(self, constraint: Constraint) -> CompiledConstraint:
        """The constraint's syntax checked with llguidance (vLLM compiles it against its own
        tokenizer). A ``grammar`` is left to vLLM: its default engine reads another dialect."""
        if constraint.kind == "grammar":
            return CompiledConstraint(constraint, constraint.spec)
        return CompiledConstraint(constraint, checked_grammar(constraint))

    def submit(self, request: GenerationRequest) -> DeltaChannel:
        if self._closed:
            raise BackendUnavailableError("the vLLM backend is shut down")
        pool, fallback = self._route(request)
        holder: dict[str, Any] = {}

        def cancel() -> None:
            future = holder.get("future")
            if future is not None:
                future.cancel()

        handle = DeltaChannel(keep_logprobs=request.sampling.logprobs is not None, on_cancel=cancel)
        # Taken here: the backend's loop thread does not run in the caller's trace context.
        headers = trace_headers()
        holder["future"] = asyncio.run_coroutine_threadsafe(
            self._generate(handle, request, pool, fallback, headers), self._loop
        )
        return handle

    def _route(self, request: GenerationRequest) -> tuple[Pool, bool]:
        """The pool a request goes to, and whether that is a fallback."""
        asked = request.speculative.method
        if asked == "none":
            if not self._replicas.has("plain"):
                raise MethodUnavailableError(
                    "This server has no vLLM replica without speculation; "
                    "'speculative: false' cannot be honoured.",
                    param="speculative",
                )
            return "plain", False
        method = self._spec_method
        if method is None or (asked is None and self._card.default_method == "none"):
            return "plain", False
        if asked is not None and asked != method:
            raise MethodUnavailableError(
                f"Speculation method '{asked}' is not served here; served: {method}.",
                param="speculative.method",
            )
        if self._replicas.has("plain") and not self._monitor.admit(method):
            return "plain", True
        return "speculative", False

    async def _generate(
        self,
        handle: DeltaChannel,
        request: GenerationRequest,
        pool: Pool,
        fallback: bool,
        headers: dict[str, str],
    ) -> None:
        tried: list[Replica] = []
        while True:
            replica = self._replicas.pick(pool, exclude=tried)
            if replica is None and request.speculative.method != "none":
                other: Pool = "plain" if pool == "speculative" else "speculative"
                replica = self._replicas.pick(other, exclude=tried)
                if replica is not None:
                    pool, fallback = other, fallback or other == "plain"
            if replica is None:
                handle.put(BackendUnavailableError("no vLLM replica can take the request now"))
                return
            replica.outstanding += 1
            try:
                await self._stream(handle, request, replica, fallback, headers)
                return
            except (httpx.TransportError, _StatusError) as error:
                if isinstance(error, _StatusError) and error.status < 500:
                    if error.status == 400:
                        handle.put(InvalidRequestError(error.message))
                    else:
                        handle.put(BackendUnavailableError(f"vLLM answered {error}"))
                    return
                self._emit(replica.take_out(f"request failed: {type(error).__name__}: {error}"))
                tried.append(replica)
            except _MidStreamError as error:
                self._emit(replica.take_out(str(error)))
                handle.put(BackendUnavailableError(str(error)))
                return
            except WireError as error:
                handle.put(BackendUnavailableError(f"vLLM answered out of protocol: {error}"))
                return
            finally:
                replica.outstanding -= 1

    async def _stream(
        self,
        handle: DeltaChannel,
        request: GenerationRequest,
        replica: Replica,
        fallback: bool,
        headers: dict[str, str],
    ) -> None:
        """Forward one generation (``headers``: the caller's trace context); raises a
        transport or status error only before the first piece (the caller may retry
        elsewhere), ``_MidStreamError`` after it."""
        started = time.perf_counter()
        first_token_at: float | None = None
        output_tokens = 0
        finish: FinishReason | None = None
        per_request: dict[str, Any] | None = None
        body = completion_body(self._vllm_name, request)
        async with self._client.stream(
            "POST", f"{replica.url}/v1/completions", json=body, headers=headers
        ) as response:
            if response.status_code != 200:
                await response.aread()
                raise _StatusError(response.status_code, _error_message(response))
            try:
                async for line in response.aiter_lines():
                    piece = parse_event(line, request.sampling.logprobs)
                    if piece is None:
                        continue
                    if piece.usage is not None or piece.speculative is not None:
                        per_request = piece.speculative or per_request
                        continue
                    if piece.text or piece.token_ids:
                        if first_token_at is None:
                            first_token_at = time.perf_counter()
                        output_tokens += len(piece.token_ids)
                        handle.put(
                            StreamDelta(piece.text, piece.token_ids, logprobs=piece.logprobs)
                        )
                    finish = piece.finish_reason or finish
            except httpx.TransportError as error:
                raise _MidStreamError(
                    f"vLLM replica {replica.url} failed mid-stream: {error}"
                ) from error
        if finish is None:
            raise _MidStreamError(f"vLLM replica {replica.url} ended the stream unfinished")
        stats = await self._stats(request, replica, output_tokens, per_request, fallback)
        stats.time_to_first_token_s = (first_token_at or time.perf_counter()) - started
        stats.total_time_s = time.perf_counter() - started
        asked = request.sampling.logprobs is not None
        handle.put(StreamDelta("", (), finish, stats, () if asked else None))

    async def _stats(
        self,
        request: GenerationRequest,
        replica: Replica,
        output_tokens: int,
        per_request: dict[str, Any] | None,
        fallback: bool,
    ) -> GenerationStats:
        stats = GenerationStats(
            method="none",
            num_prompt_tokens=len(request.prompt_ids),
            num_output_tokens=output_tokens,
            num_target_passes=output_tokens,
            fallback_active=fallback,
            acceptance_source="per_request",
            replica=replica.url,
            max_batch_size=None,  # vLLM does not say what shared the request's steps
        )
        if replica.pool != "speculative" or self._spec_method is None:
            return stats
        if per_request is not None:
            figures = request_figures(per_request)
        else:
            figures = await self._attribution[id(replica)].wait(output_tokens)
            stats.acceptance_source = "interval"
        stats.method = self._spec_method
        stats.num_drafts = figures.num_drafts
        stats.num_draft_tokens = figures.num_draft_tokens
        stats.num_accepted_tokens = figures.num_accepted_tokens
        stats.num_accepted_tokens_per_pos = list(figures.num_accepted_tokens_per_pos)
        # One target pass verifies each draft; the other tokens came from plain passes.
        stats.num_target_passes = figures.num_drafts + max(
            0, output_tokens - figures.num_drafts - figures.num_accepted_tokens
        )
        self._monitor.record(
            self._spec_method,
            figures.num_draft_tokens,
            figures.num_accepted_tokens,
            passes=figures.num_drafts,
        )
        return stats

    def health(self) -> BackendHealth:
        if self._closed:
            return BackendHealth(False, "the vLLM backend is shut down")
        if self._replicas.any_healthy() is None:
            errors = "; ".join(f"{r.url}: {r.last_error}" for r in self._replicas.all)
            return BackendHealth(False, f"no vLLM replica is up ({errors})")
        return BackendHealth(True)

    @property
    def queue_depth(self) -> int:
        return self._replicas.outstanding

    def fallback_state(self) -> dict[Method, bool]:
        if self._spec_method is None:
            return {}
        return {self._spec_method: self._monitor.is_disabled(self._spec_method)}

    @property
    def speculation_crossover(self) -> None:
        """Not offered: vLLM schedules its own batches."""
        return None

    @property
    def speculation_speedup(self) -> None:
        """Not offered: the servers' pass costs are not measured here."""
        return None

    @property
    def divergence(self) -> None:
        """Not offered: the servers' logits are not the gateway's to read."""
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._client.aclose()

        try:
            self._call(stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._sync.close()


def load_vllm_backend(
    settings: Settings, on_fallback: Callable[[FallbackEvent], None]
) -> VllmBackend:
    return VllmBackend.load(settings, on_fallback)
