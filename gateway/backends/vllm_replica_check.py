"""Each vLLM replica's served configuration, checked against what its pool is configured with.

The audit records what the operator wrote (served model, speculative configuration); a
replica restarted otherwise (without ``--speculative-config``, on another model) would keep
answering ``/health`` and be served from as if it matched. So the backend reads what vLLM
itself exposes, at admission and on every health check, and refuses (keeps out of
rotation) a replica that differs:

- ``GET /metrics``, on every health check: the ``vllm:spec_decode_*`` series, which a server
  has exactly when it was started with a speculative configuration, the ``position`` labels
  of ``vllm:spec_decode_num_accepted_tokens_per_pos``, one per speculative token (its
  ``k``), and what a restart changes: the process's start time
  (``process_start_time_seconds``, to 10 ms), the creation time of vLLM's first counter (to
  the microsecond) and the ``model_name`` labels;
- ``GET /v1/models`` (the served model names and their ``max_model_len``) and ``GET
  /version`` (recorded, not compared: the configuration names no vLLM version), at
  admission and after every restart the start time shows. vLLM counts ``/v1/models`` in its
  own request metrics (``/metrics``, ``/health`` and ``/version`` it does not), so polling it
  every interval would show on the operator's dashboards as traffic.

vLLM does not expose the speculative method (n-gram, draft model, ...), so a replica started
with another method but the same ``k`` is not told apart.

Every change of a replica's outcome or of what it serves is a ``ReplicaCheck``, audited as a
`backend_replica_check` event.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from gateway.backends.vllm_replicas import Pool
from gateway.backends.vllm_wire import ACCEPTED_PER_POSITION

SPEC_SERIES_PREFIX = "vllm:spec_decode_"
_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Outcome = Literal["admitted", "refused"]


@dataclass(frozen=True)
class Expected:
    """What a replica must serve: the backend's model, a context at least as long as the one
    the gateway admits prompts for, and speculation exactly when its pool speculates (with
    the configured ``num_speculative_tokens``, where one is configured)."""

    model: str
    min_model_len: int | None
    speculative: bool
    num_speculative_tokens: int | None

    @classmethod
    def for_replica(
        cls,
        model: str,
        min_model_len: int | None,
        pool: Pool,
        speculative_config: Mapping[str, Any] | None,
    ) -> Expected:
        k = (speculative_config or {}).get("num_speculative_tokens")
        speculative = pool == "speculative"
        checked_k = k if speculative and isinstance(k, int) else None
        return cls(model, min_model_len, speculative, checked_k)

    def as_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "min_model_len": self.min_model_len,
            "speculative": self.speculative,
            "num_speculative_tokens": self.num_speculative_tokens,
        }


@dataclass(frozen=True)
class Served:
    """What a replica says it serves."""

    models: tuple[str, ...]
    max_model_len: dict[str, int]
    speculative: bool
    num_speculative_tokens: int | None
    version: str | None

    def as_dict(self) -> dict[str, object]:
        return {
            "models": list(self.models),
            "max_model_len": dict(self.max_model_len),
            "speculative": self.speculative,
            "num_speculative_tokens": self.num_speculative_tokens,
            "version": self.version,
        }


@dataclass(frozen=True)
class MetricsFacts:
    """What a replica's ``/metrics`` page says of its configuration, and of the process
    behind it (``started``: its start and counter creation times and model names; None where
    the page has no times, so that no restart can be seen)."""

    speculative: bool
    num_speculative_tokens: int | None
    started: str | None


def read_metrics(exposition: str) -> MetricsFacts:
    speculative = False
    positions: set[str] = set()
    process_start: str | None = None
    first_created: str | None = None
    model_names: set[str] = set()
    for line in exposition.splitlines():
        match = _SERIES.match(line)
        if match is None:
            continue
        name = match.group(1)
        labels = dict(_LABEL.findall(match.group(2) or ""))
        model_names.update([labels["model_name"]] if "model_name" in labels else [])
        if name == "process_start_time_seconds":
            process_start = line.split()[-1]
        elif first_created is None and name.startswith("vllm:") and name.endswith("_created"):
            first_created = line.split()[-1]
        if not name.startswith(SPEC_SERIES_PREFIX):
            continue
        speculative = True
        if name.removesuffix("_total") == ACCEPTED_PER_POSITION and "position" in labels:
            positions.add(labels["position"])
    times = [t for t in (process_start, first_created) if t is not None]
    started = " ".join([*times, *sorted(model_names)]) if times else None
    return MetricsFacts(speculative, len(positions) if positions else None, started)


def read_served(models: Any, version: Any, metrics: MetricsFacts) -> Served:
    """``Served`` from the bodies of ``/v1/models`` and ``/version`` (JSON) and the facts of
    ``/metrics``; raises ``ValueError`` on a ``/v1/models`` body of another shape."""
    try:
        entries = [(str(m["id"]), m.get("max_model_len")) for m in models["data"]]
    except (KeyError, TypeError) as error:
        raise ValueError(f"/v1/models answered {str(models)[:200]!r}") from error
    return Served(
        models=tuple(name for name, _ in entries),
        max_model_len={name: int(length) for name, length in entries if length},
        speculative=metrics.speculative,
        num_speculative_tokens=metrics.num_speculative_tokens,
        version=str(version.get("version")) if isinstance(version, dict) else None,
    )


def differences(expected: Expected, served: Served) -> tuple[str, ...]:
    """How ``served`` differs from ``expected``, one sentence each; empty where it matches."""
    found: list[str] = []
    if expected.model not in served.models:
        found.append(f"serves {list(served.models)}, not {expected.model!r}")
    length = served.max_model_len.get(expected.model)
    least = expected.min_model_len
    if least is not None and length is not None and length < least:
        found.append(f"max_model_len {length} < the gateway's {least}")
    if expected.speculative and not served.speculative:
        found.append("runs without speculative decoding (no vllm:spec_decode_* series)")
    if served.speculative and not expected.speculative:
        found.append("runs speculative decoding in the plain pool")
    k = expected.num_speculative_tokens
    if k is not None and served.speculative and served.num_speculative_tokens not in (None, k):
        found.append(f"speculates {served.num_speculative_tokens} tokens, not {k}")
    return tuple(found)


@dataclass(frozen=True)
class ReplicaCheck:
    """A replica's configuration was checked and admitted or refused (audited when the
    outcome or what it serves changes: at admission, after a restart)."""

    kind: ClassVar[str] = "backend_replica_check"

    url: str
    pool: Pool
    outcome: Outcome
    differences: tuple[str, ...]
    served: Served
    expected: Expected
    timestamp: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, object]:
        return {
            "url": self.url,
            "pool": self.pool,
            "outcome": self.outcome,
            "differences": list(self.differences),
            "served": self.served.as_dict(),
            "expected": self.expected.as_dict(),
            "timestamp": self.timestamp,
        }


class CheckHistory:
    """The last outcome and served configuration per replica URL, so that only changes are
    reported. Used on the backend's event loop only."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[Outcome, Served]] = {}

    def judge(
        self, url: str, pool: Pool, expected: Expected, served: Served
    ) -> tuple[tuple[str, ...], ReplicaCheck | None]:
        """The differences, and the check to report when it is news."""
        found = differences(expected, served)
        outcome: Outcome = "refused" if found else "admitted"
        if self._last.get(url) == (outcome, served):
            return found, None
        self._last[url] = (outcome, served)
        return found, ReplicaCheck(url, pool, outcome, found, served, expected)
