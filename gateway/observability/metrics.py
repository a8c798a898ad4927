"""Prometheus metrics, one dedicated registry per app so that apps never share counters.

Label values are only ever route templates, status codes, model names, method names,
fallback actions, audit event kinds and workloads (a route template and an API key's name,
which operators create): nothing a client writes reaches a label.
The speculation counters follow vLLM's ``spec_decode`` counters, so that acceptance rate
(accepted / draft tokens) and mean acceptance length (1 + accepted / drafts) follow
from them in PromQL as they do for vLLM. With ``vllm_names`` (setting
``metrics_vllm_names``) they, and the prompt and generation token counters, are exported a
second time under vLLM's own names and label (``vllm:spec_decode_num_drafts_total{model_name}``
and so on), so that dashboards built for vLLM read the gateway unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine.api.types import SPECULATION_FIGURES, FallbackEvent, GenerationStats, Method

REQUEST_DURATION_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
AUDIT_WRITE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
# The speculation figures vLLM exports as vllm:spec_decode_* counters.
VLLM_SPEC_DECODE = frozenset(
    {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"}
)


class Metrics:
    """The gateway's metrics in their own :class:`CollectorRegistry`."""

    def __init__(self, vllm_names: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "specgate_requests",
            "HTTP requests by route template and status code.",
            ["route", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "specgate_request_duration_seconds",
            "HTTP request latency, until the last body byte.",
            ["route"],
            buckets=REQUEST_DURATION_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "specgate_time_to_first_token_seconds",
            "Time from engine submission to the first token.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.generation_tokens = Counter(
            "specgate_generation_tokens",
            "Completion tokens generated.",
            ["model"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "specgate_prompt_tokens",
            "Prompt tokens processed.",
            ["model"],
            registry=r,
        )
        spec_labels = ["method", "model"]
        # One counter per counted speculation figure (engine.api.types.SPECULATION_FIGURES).
        self.speculation_counters: dict[str, Counter] = {
            figure.name: Counter(
                figure.metric,
                figure.description,
                [*spec_labels, "position"] if figure.kind == "per_position" else spec_labels,
                registry=r,
            )
            for figure in SPECULATION_FIGURES
            if figure.metric is not None
        }
        # The same counts under vLLM's names (no method label: vLLM serves one method).
        self.vllm_counters: dict[str, Counter] = (
            {
                name: Counter(
                    metric.replace("specgate_", "vllm:", 1),
                    description,
                    ["model_name", "position"] if name.endswith("_per_pos") else ["model_name"],
                    registry=r,
                )
                for name, metric, description in [
                    *(
                        (figure.name, figure.metric, figure.description)
                        for figure in SPECULATION_FIGURES
                        if figure.metric is not None and figure.name in VLLM_SPEC_DECODE
                    ),
                    ("num_prompt_tokens", "specgate_prompt_tokens", "Prompt tokens processed."),
                    ("num_output_tokens", "specgate_generation_tokens", "Generation tokens."),
                ]
            }
            if vllm_names
            else {}
        )
        self.speculation_disabled = Gauge(
            "specgate_speculation_disabled",
            "1 while a method is switched off by fallback.",
            spec_labels,
            registry=r,
        )
        self.speculation_crossover = Gauge(
            "specgate_speculation_crossover_batch_size",
            "Smallest batch size at which adaptive k stops speculating with the method, from "
            "measured pass costs and the method's current acceptance (+Inf: it pays up to "
            "max_num_seqs).",
            spec_labels,
            registry=r,
        )
        drift_labels = [*spec_labels, "workload"]
        self.rolling_acceptance = Gauge(
            "specgate_acceptance_rolling_rate",
            "Acceptance rate (accepted / draft tokens) of the newest requests of a workload "
            "(route and API key name) over the drift window of draft tokens.",
            drift_labels,
            registry=r,
        )
        self.expected_acceptance = Gauge(
            "specgate_acceptance_expected_rate",
            "Acceptance rate the applied tuning report measured for the workload's cluster "
            "(else for all of the model's traffic).",
            drift_labels,
            registry=r,
        )
        self.estimated_speedup = Gauge(
            "specgate_speculation_estimated_speedup",
            "Estimated speedup over plain decoding of the window's requests at the engine's "
            "measured pass costs (the fallback's estimate).",
            drift_labels,
            registry=r,
        )
        self.acceptance_drift = Gauge(
            "specgate_acceptance_drift",
            "1 while the window, once it holds its draft tokens, is below the measured "
            "acceptance less the margin or below the floor.",
            drift_labels,
            registry=r,
        )
        self.fallback_switches = Counter(
            "specgate_fallback_switches",
            "Fallback switches of a method off (disabled) or on (enabled).",
            ["method", "model", "action"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "specgate_queue_depth",
            "Requests waiting in the engine queue.",
            registry=r,
        )
        self.replica_up = Gauge(
            "specgate_backend_replica_up",
            "1 while a remote backend replica is in rotation, 0 while it is taken out.",
            ["url", "pool"],
            registry=r,
        )
        self.replica_outstanding = Gauge(
            "specgate_backend_replica_outstanding",
            "Requests in flight on a remote backend replica.",
            ["url", "pool"],
            registry=r,
        )
        self.replica_changes = Counter(
            "specgate_backend_replica_changes",
            "Remote backend replicas taken out (removed) or put back (restored).",
            ["url", "pool", "action"],
            registry=r,
        )
        self.audit_write_duration = Histogram(
            "specgate_audit_write_duration_seconds",
            "Latency of one audit append, by event kind.",
            ["kind"],
            buckets=AUDIT_WRITE_BUCKETS,
            registry=r,
        )
        self.audit_write_failures = Counter(
            "specgate_audit_write_failures",
            "Audit appends that failed, by event kind.",
            ["kind"],
            registry=r,
        )
        self.audit_tamper_detected = Counter(
            "specgate_audit_tamper_detected",
            "Times the gateway found the audit database not extending what it signed.",
            registry=r,
        )
        self.audit_reverified = Gauge(
            "specgate_audit_reverified_timestamp_seconds",
            "When the last re-verification of the whole signed audit history completed.",
            registry=r,
        )
        self.audit_reverify_duration = Gauge(
            "specgate_audit_reverify_duration_seconds",
            "How long the last completed re-verification of the signed history took.",
            registry=r,
        )

    def watch_engine(
        self,
        model: str,
        methods: tuple[Method, ...],
        queue_depth: Callable[[], int],
        fallback_state: Callable[[], Mapping[Method, bool]],
        crossover: Callable[[Method], float] | None = None,
    ) -> None:
        """Read queue depth, fallback state and the speculation crossover from the engine at
        each scrape.

        Reading at scrape time keeps the gauges exact without any bookkeeping here.
        """
        self.queue_depth.set_function(lambda: float(queue_depth()))
        for method in methods:
            self.speculation_disabled.labels(method, model).set_function(
                _disabled_flag(fallback_state, method)
            )
            if crossover is not None:
                self.speculation_crossover.labels(method, model).set_function(
                    _bound(crossover, method)
                )

    def watch_replicas(self, states: Callable[[], list[tuple[str, str, bool, int]]]) -> None:
        """Read each replica's rotation state and load at each scrape."""
        for index, (url, pool, _, _) in enumerate(states()):
            self.replica_up.labels(url, pool).set_function(
                lambda index=index: float(states()[index][2])  # type: ignore[misc]
            )
            self.replica_outstanding.labels(url, pool).set_function(
                lambda index=index: float(states()[index][3])  # type: ignore[misc]
            )

    def observe_replica(self, url: str, pool: str, action: str) -> None:
        self.replica_changes.labels(url, pool, action).inc()

    def observe_request(self, route: str, status: int, duration_s: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.request_duration.labels(route).observe(duration_s)

    def observe_generation(self, model: str, stats: GenerationStats) -> None:
        """Count one finished generation: tokens, time to first token, speculation figures."""
        self.prompt_tokens.labels(model).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(model).inc(stats.num_output_tokens)
        if stats.num_output_tokens:
            self.time_to_first_token.labels(model).observe(stats.time_to_first_token_s)
        figures = stats.speculation()
        for figure in SPECULATION_FIGURES:
            counter = self.speculation_counters.get(figure.name)
            if counter is None or not (figure.every_request or stats.num_drafts):
                continue
            value = figures[figure.name]
            if isinstance(value, list):
                for position, count in enumerate(value):
                    counter.labels(stats.method, model, str(position)).inc(count)
            elif isinstance(value, int | float):
                counter.labels(stats.method, model).inc(value)
        self._observe_vllm_names(model, stats, figures)

    def _observe_vllm_names(
        self, model: str, stats: GenerationStats, figures: Mapping[str, object]
    ) -> None:
        """The counts of ``observe_generation`` under vLLM's names, where configured."""
        if not self.vllm_counters:
            return
        counts = {
            **figures,
            "num_prompt_tokens": stats.num_prompt_tokens,
            "num_output_tokens": stats.num_output_tokens,
        }
        for name, counter in self.vllm_counters.items():
            value = counts[name]
            if isinstance(value, list):
                for position, count in enumerate(value):
                    counter.labels(model, str(position)).inc(count)
            elif isinstance(value, int | float) and not isinstance(value, bool):
                counter.labels(model).inc(value)

    def observe_acceptance(
        self,
        method: str,
        model: str,
        workload: str,
        rolling: float,
        expected: float | None,
        speedup: float | None,
        drifting: bool,
    ) -> None:
        """A workload's window after a request: its rate, the measured one and the speedup
        where known, and the drift flag."""
        labels = (method, model, workload)
        self.rolling_acceptance.labels(*labels).set(rolling)
        if expected is not None:
            self.expected_acceptance.labels(*labels).set(expected)
        if speedup is not None:
            self.estimated_speedup.labels(*labels).set(speedup)
        self.acceptance_drift.labels(*labels).set(float(drifting))

    def observe_fallback(self, event: FallbackEvent) -> None:
        self.fallback_switches.labels(event.method, event.model, event.action).inc()

    def observe_audit_write(self, kind: str, duration_s: float, *, failed: bool) -> None:
        self.audit_write_duration.labels(kind).observe(duration_s)
        if failed:
            self.audit_write_failures.labels(kind).inc()

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (``METRICS_CONTENT_TYPE``)."""
        return generate_latest(self.registry)


def _bound(figure: Callable[[Method], float], method: Method) -> Callable[[], float]:
    return lambda: figure(method)


def _disabled_flag(
    fallback_state: Callable[[], Mapping[Method, bool]], method: Method
) -> Callable[[], float]:
    return lambda: float(fallback_state().get(method, False))
