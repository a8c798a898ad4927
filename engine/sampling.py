"""Logits processing and the rejection-sampling rule that keeps speculation lossless.

The same ``probabilities`` function is applied to draft and target logits, so temperature,
top-k and top-p shape both distributions identically (Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.types import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of ``logits`` (``[..., vocab]``) after temperature, top-k and top-p, in float32.

    A temperature so small that ``logits / temperature`` overflows float32 would give
    ``inf - inf = NaN``; then the logits are shifted by their maximum first (softmax is
    shift-invariant, so this is the same distribution: all mass on the top logits, the limit
    of temperature -> 0). Ordinary temperatures take the unshifted path, bit for bit."""
    scaled = logits.float() / params.temperature
    if not torch.isfinite(scaled.amax(dim=-1)).all():
        raw = logits.float()
        scaled = (raw - raw.amax(dim=-1, keepdim=True)) / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = before >= params.top_p
        # A top_p below float32's smallest value rounds to 0 and would drop every token.
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying a proposal: how many proposed tokens stand, and the token after them."""

    num_accepted: int
    next_token: int


def verify_greedy(proposal: list[int], target_logits: torch.Tensor) -> Verdict:
    """Accept while the proposal equals the target's argmax (logits ``[k+1, vocab]``)."""
    best = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(proposal) and proposal[n] == best[n]:
        n += 1
    return Verdict(n, best[n])


def verify_sampled(
    proposal: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Speculative rejection sampling.

    Accept proposal token x with probability min(1, p(x)/q(x)); at the first rejection draw
    from norm(max(0, p - q)); when all are accepted draw a bonus token from p. ``draft_probs``
    of ``None`` means a deterministic proposer (n-gram lookup), whose q is one-hot.
    """
    for i, token in enumerate(proposal):
        p = target_probs[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[token] = 1.0
        else:
            q = draft_probs[i]
        ratio = (p[token] / q[token]).item() if q[token] > 0 else 0.0
        u = torch.rand((), generator=generator, device=p.device).item()
        if u < ratio:
            continue
        residual = torch.clamp(p - q, min=0.0)
        total = residual.sum()
        return Verdict(i, sample(residual / total if total > 0 else p, generator))
    return Verdict(len(proposal), sample(target_probs[len(proposal)], generator))
