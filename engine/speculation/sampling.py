"""Logits processing and the rejection-sampling rule that keeps speculation lossless.

The same ``probabilities`` function is applied to draft and target logits, so temperature,
top-k and top-p shape both distributions identically (Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from engine.api.types import SamplingParams
from engine.speculation.tree import children

if TYPE_CHECKING:  # engine.speculation.proposers imports this module
    from engine.speculation.proposers.base import Proposal


# float32's smallest normal number (2**-126): logits are scaled in float32, where anything
# smaller is imprecise (subnormal) or rounds to 0.
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)
# Dividing logits by a smaller repetition penalty overflows float32 (above 3.4e8 * penalty).
# This one already turns a seen token's positive logit of 1e-7 or more into 1e23 or more,
# beyond every unpenalised logit by more than float32 resolves, as any smaller one would.
MIN_REPETITION_PENALTY = 1e-30


def effective_sampling(params: SamplingParams) -> SamplingParams:
    """``params`` as the engine applies them, for target and proposer alike: every value the
    API accepts, brought to one float32 can compute with. A temperature below float32's
    smallest normal number is greedy (0: its limit); a ``top_p`` below it is raised to it
    (either keeps only the top token); a ``repetition_penalty`` below
    ``MIN_REPETITION_PENALTY`` is raised to it. The additive penalties and ``logit_bias``
    are bounded (|2 x count|, |100|), so they cannot overflow and stay as given."""
    return replace(
        params,
        temperature=0.0 if params.temperature < FLOAT32_TINY else params.temperature,
        top_p=max(params.top_p, FLOAT32_TINY),
        repetition_penalty=max(params.repetition_penalty, MIN_REPETITION_PENALTY),
    )


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of ``logits`` (``[..., vocab]``) after temperature, min-p, top-k and top-p (vLLM's
    order), in float32,
    for ``effective_sampling`` parameters that are not greedy.

    A temperature so small that ``logits / temperature`` overflows float32 would give
    ``inf - inf = NaN``; then the logits are shifted by their maximum first (softmax is
    shift-invariant, so this is the same distribution: all mass on the top logits, the limit
    of temperature -> 0). Ordinary temperatures take the unshifted path, bit for bit."""
    scaled = logits.float() / params.temperature
    if not torch.isfinite(scaled.amax(dim=-1)).all():
        raw = logits.float()
        scaled = (raw - raw.amax(dim=-1, keepdim=True)) / params.temperature
    if params.min_p > 0.0:
        scaled = _min_p_filtered(scaled, params.min_p)
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = before >= params.top_p  # never the first: its ``before`` is 0
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def _min_p_filtered(scaled: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop every token whose probability (at this temperature) is below ``min_p`` times the
    most likely token's; the most likely always stays."""
    probs = torch.softmax(scaled, dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return scaled.masked_fill(probs < threshold, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


@dataclass(frozen=True)
class TreeVerdict:
    """Outcome of verifying a proposal: the accepted node indices, root child first (a chain's
    accepted prefix is 0..m-1), and the token after them."""

    path: tuple[int, ...]
    next_token: int


def verify_tree_greedy(proposal: Proposal, target_logits: torch.Tensor) -> TreeVerdict:
    """Walk down the tree along the target's argmax (logits ``[n+1, vocab]``, row 0 at the
    last committed token, row i+1 at node i); the first child carrying it is taken."""
    best = target_logits.argmax(dim=-1).tolist()
    below = children(proposal.parent_indices())
    tokens = proposal.tokens
    path: list[int] = []
    row = 0
    while True:
        node = next((c for c in below[row] if tokens[c] == best[row]), None)
        if node is None:
            return TreeVerdict(tuple(path), best[row])
        path.append(node)
        row = node + 1


def verify_tree_sampled(
    proposal: Proposal, target_probs: torch.Tensor, generator: torch.Generator
) -> TreeVerdict:
    """Recursive rejection sampling over siblings (SpecInfer; EAGLE; Jeon et al. 2024).

    At each accepted row try its children in order: accept child x with probability
    min(1, p(x)/q(x)), q being the distribution x was drawn from (``proposal.probs``, one-hot
    where None); on rejection replace p by norm(max(0, p - q)) and try the next sibling; when
    all are rejected draw from what remains of p. A chain takes exactly the draws, in the same
    order, of plain speculative rejection sampling (Leviathan et al. 2023).

    With one-hot q a rejection zeroes p(x); a second sibling carrying x would then be tried
    against a p that no longer holds it, which is a proposer's bug (it wastes the node), so
    duplicate siblings of a deterministic proposal are refused.
    """
    below = children(proposal.parent_indices())
    tokens, probs = proposal.tokens, proposal.probs
    if probs is None:
        for siblings in below:
            if len({tokens[c] for c in siblings}) < len(siblings):
                raise ValueError("a deterministic proposal has duplicate siblings")
    path: list[int] = []
    row = 0
    while True:
        p = target_probs[row]
        accepted = None
        for node in below[row]:
            token = tokens[node]
            if probs is None:
                q = torch.zeros_like(p)
                q[token] = 1.0
            else:
                q = probs[node]
            ratio = (p[token] / q[token]).item() if q[token] > 0 else 0.0
            u = torch.rand((), generator=generator, device=p.device).item()
            if u < ratio:
                accepted = node
                break
            residual = torch.clamp(p - q, min=0.0)
            total = residual.sum()
            if total > 0:
                p = residual / total
        if accepted is None:
            return TreeVerdict(tuple(path), sample(p, generator))
        path.append(accepted)
        row = accepted + 1
