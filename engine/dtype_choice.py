"""Which dtype decodes faster on this CPU, measured rather than guessed from CPU flags.

A decode or verification pass of a model that does not fit in the CPU caches is a stream of
matrix-vector products over every weight, so the faster dtype is the one whose products over
cache-cold weights of the model's own shapes take less time. bfloat16 halves the bytes but is
only fast where the CPU computes it natively (AVX512-BF16, AMX); where it is emulated it is
many times slower, and on some CPUs float32 kernels win at small widths. Measured here on an
AMD EPYC with AVX512-BF16 (2 shared cores), SmolLM2-135M's layer shapes: bfloat16 1.6x
faster for one token and 3x faster for five (float32 kernels slow down sharply past one row).
Timing takes a few tens of milliseconds, once per shape per process.
"""

from __future__ import annotations

import functools
import time

import torch

from engine.packed_linear import PackedLinear, can_pack

CANDIDATES = (torch.bfloat16, torch.float32)
# Enough copies of a layer's weights that each pass reads them from memory, not from cache.
_COLD_BYTES = 64 * 1024 * 1024
_ROUNDS = 3


def _seconds(weights: list[torch.Tensor], rows: int) -> float:
    """Median time of one sweep of products of ``rows`` input rows with every weight, through
    the layers the engine serves with (``engine.packed_linear``)."""
    inputs = {
        w.shape[1]: torch.randn(rows, w.shape[1]).to(w.dtype) for w in weights
    }
    layers = [_as_served(w) for w in weights]
    times = []
    for _ in range(_ROUNDS + 1):  # the first round warms up
        started = time.perf_counter()
        for layer in layers:
            layer(inputs[layer.in_features])
        times.append(time.perf_counter() - started)
    return sorted(times[1:])[_ROUNDS // 2]


@functools.cache
def faster_cpu_dtype(hidden: int, intermediate: int, verify_tokens: int = 5) -> torch.dtype:
    """The candidate dtype with the least time for a one-token and a ``verify_tokens``-token
    pass through a decoder layer's projections (hidden to hidden, and to and from
    ``intermediate``), over cache-cold copies of them."""
    shapes = [(hidden, hidden), (hidden, hidden), (intermediate, hidden),
              (intermediate, hidden), (hidden, intermediate)]
    layer_bytes = sum(o * i for o, i in shapes) * 4
    copies = max(1, _COLD_BYTES // layer_bytes)
    best: tuple[float, torch.dtype] | None = None
    with torch.inference_mode():
        for dtype in CANDIDATES:
            weights = [
                torch.randn(o, i, dtype=torch.float32).to(dtype)
                for _ in range(copies)
                for o, i in shapes
            ]
            total = _seconds(weights, 1) + _seconds(weights, verify_tokens)
            if best is None or total < best[0]:
                best = (total, dtype)
    assert best is not None
    return best[1]


def _as_served(weight: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    return PackedLinear(layer) if can_pack(layer) else layer
