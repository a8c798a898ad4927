"""Which dtype decodes faster on this CPU, measured rather than guessed from CPU flags.

A decode or verification pass of a model that does not fit in the CPU caches is a stream of
matrix-vector products over every weight, so the faster dtype is the one whose products over
cache-cold weights of the model's own shapes take less time. bfloat16 halves the bytes but is
only fast where the CPU computes it natively (AVX512-BF16, AMX); where it is emulated it is
many times slower, and on some CPUs float32 kernels win at small widths, so the choice is
measured on the CPU that serves. Timing takes about a second on a quiet machine (longer on busy
shared cores), once per shape per process.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.models.packed_linear import PackedLinear, can_pack

CANDIDATES = (torch.bfloat16, torch.float32)
# Enough copies of a layer's weights that each pass reads them from memory, not from cache.
_COLD_BYTES = 64 * 1024 * 1024
_ROUNDS = 5


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype the target is served in, why, and (where it was measured) the median CPU
    seconds of the probe for each candidate: recorded in the `startup` event and answered by
    ``GET /v1/models``, so that which dtype `auto` chose is on record."""

    requested: str
    dtype: torch.dtype
    reason: str
    cpu_seconds: dict[str, float] = field(default_factory=dict)

    def as_record(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "chosen": dtype_name(self.dtype),
            "reason": self.reason,
            "measured_cpu_s": dict(self.cpu_seconds),
        }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sweep_seconds(layers: list[torch.nn.Linear], inputs: dict[int, torch.Tensor]) -> float:
    """CPU seconds of one sweep of products through every layer, each of its input rows
    (``inputs`` by width). CPU time, not wall time: other processes on shared cores stretch
    a sweep's wall time by whatever they take, which at a load of several times the cores
    decided the choice more than the kernels did."""
    started = time.process_time()
    for layer in layers:
        layer(inputs[layer.in_features])
    return time.process_time() - started


@functools.cache
def faster_cpu_dtype(hidden: int, intermediate: int, verify_tokens: int = 5) -> DtypeChoice:
    """The candidate dtype with the least median CPU time for a one-token plus a
    ``verify_tokens``-token pass through a decoder layer's projections (hidden to hidden, and
    to and from ``intermediate``), over cache-cold copies of them, through the layers the
    engine serves with (``engine.models.packed_linear``). Rounds alternate between the dtypes so
    that a change of load hits both alike."""
    shapes = [(hidden, hidden), (hidden, hidden), (intermediate, hidden),
              (intermediate, hidden), (hidden, intermediate)]
    layer_bytes = sum(o * i for o, i in shapes) * 4
    copies = max(1, _COLD_BYTES // layer_bytes)
    with torch.inference_mode():
        weights = [torch.randn(o, i) for _ in range(copies) for o, i in shapes]
        layers = {dtype: [_as_served(w.to(dtype)) for w in weights] for dtype in CANDIDATES}
        inputs = {
            (dtype, rows): {width: torch.randn(rows, width).to(dtype) for width in widths}
            for dtype in CANDIDATES
            for rows in (1, verify_tokens)
            for widths in [{hidden, intermediate}]
        }
        times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in CANDIDATES}
        for round_ in range(_ROUNDS + 1):  # the first round warms up
            for dtype in CANDIDATES:
                total = sum(
                    _sweep_seconds(layers[dtype], inputs[(dtype, rows)])
                    for rows in (1, verify_tokens)
                )
                if round_:
                    times[dtype].append(total)
    medians = {dtype: statistics.median(times[dtype]) for dtype in CANDIDATES}
    return DtypeChoice(
        "auto",
        min(CANDIDATES, key=medians.__getitem__),
        "measured faster for the model's layer shapes on this CPU",
        {dtype_name(dtype): round(seconds, 6) for dtype, seconds in medians.items()},
    )


def _as_served(weight: torch.Tensor) -> torch.nn.Linear:
    # Built on the meta device, so that no initial weights are drawn only to be replaced.
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    return PackedLinear(layer) if can_pack(layer) else layer
