"""Whether a model can verify proposals: a pass over several tokens after a cached prefix
must give the logits that one-token passes give.

Speculative verification feeds k + 1 tokens in one pass. Most architectures compute that
exactly; transformers' Mamba does not (its multi-token scan restarts from a zero state,
ignoring the cached one), so its verification logits would be wrong. The engine checks this
once at load and offers no speculation where it fails, rather than serve a degraded copy.
"""

from __future__ import annotations

import torch

from engine.models.model_runner import ModelRunner

# Agreement asked of the two ways, relative to the largest logit: rounding in float32, and
# the rounding of a half-precision dtype (a pass over several tokens may sum differently).
_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
_HALF_TOLERANCE = 5e-2
PROBE_PREFIX = 12
PROBE_TOKENS = 3


def continues_exactly(runner: ModelRunner, vocab_size: int) -> bool:
    """Feed a prefix, then ``PROBE_TOKENS`` tokens once together and once one by one; whether
    the logits agree. Leaves the runner reset."""
    tokens = [3 + (7 * i) % max(1, vocab_size - 3) for i in range(PROBE_PREFIX + PROBE_TOKENS)]
    prefix, tail = tokens[:PROBE_PREFIX], tokens[PROBE_PREFIX:]
    runner.reset()
    runner.forward(prefix, last_only=True)
    together = runner.forward(tail)
    runner.reset()
    runner.forward(prefix, last_only=True)
    apart = torch.cat([runner.forward([token]) for token in tail])
    runner.reset()
    dtype = runner.model.dtype
    tolerance = _TOLERANCE.get(dtype, _HALF_TOLERANCE)
    scale = float(apart.abs().max()) or 1.0
    return float((together - apart).abs().max()) <= tolerance * scale
