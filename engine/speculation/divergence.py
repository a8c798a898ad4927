"""Where a speculative greedy output first differs from plain decoding, and whether rounding
explains it.

In bfloat16 or float16 one verification pass over several tokens reduces in another order
than several one-token steps, so the same logit can come out a little different. Where the
target's top two logits are closer than that, greedy speculation may pick the other one: the
output is then still the target's greedy choice *in that dtype*, only at a near-tie. A
divergence where the logit gap is wider than the dtype's rounding is a bug.

``first_divergence`` recomputes the target's logits at the first differing position twice,
as plain decoding computes them (the prompt prefilled, then one-token steps) and as one
verification pass of ``pass_length`` tokens starting at that position computes them, and
compares the plain view's gap with ``rounding_bound``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from engine.models.model_runner import ModelRunner

# How many units in the last place (at the larger of the two logits' magnitude) one logit gap
# may move by between a multi-token pass and one-token steps from rounding alone. Each logit is
# rounded at the head's output (half a unit), but the hidden state it comes from carries the
# rounding of every layer's bf16 matmuls and residual adds, which the two passes reduce in
# another order. Measured on SmolLM2-135M-Instruct in bfloat16 (30 layers; 5-token passes
# against one-token steps, random contexts): single logits moved by up to 6 units, so a gap
# (two logits) by up to 12; 16 leaves a margin. The tiny test models moved by none. A gap
# beyond this is not rounding (docs/engine.md, "Greedy exactness in low precision").
ROUNDING_ULPS = 16.0


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s floating-point numbers at ``|value|`` (its normal range)."""
    info = torch.finfo(dtype)
    magnitude = max(abs(value), info.tiny)
    return float(info.eps) * 2.0 ** math.floor(math.log2(magnitude))


def rounding_bound(magnitude: float, dtype: torch.dtype) -> float:
    """The widest logit gap that ``dtype``'s rounding can close or invert between two passes."""
    return ROUNDING_ULPS * ulp(magnitude, dtype)


@dataclass(frozen=True)
class Divergence:
    """The first position (in generated tokens) where two greedy outputs differ.

    ``plain_gap``: the target's logit of the plain token minus that of the other token, as
    plain decoding computes them (at least 0: plain decoding took the argmax).
    ``verify_gap``: the same difference as a multi-token verification pass computes it
    (negative where that pass prefers the other token, as speculation did).
    """

    position: int
    plain_token: int
    other_token: int
    plain_gap: float
    verify_gap: float
    bound: float
    dtype: str

    @property
    def within_rounding(self) -> bool:
        return self.plain_gap <= self.bound

    def as_dict(self) -> dict[str, object]:
        return {
            "position": self.position,
            "plain_token": self.plain_token,
            "other_token": self.other_token,
            "plain_gap": self.plain_gap,
            "verify_gap": self.verify_gap,
            "bound": self.bound,
            "dtype": self.dtype,
            "within_rounding": self.within_rounding,
        }


def first_difference(plain: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first differing token; ``None`` when one output is a prefix of the other
    (one stopped earlier: no token differs)."""
    for index, (a, b) in enumerate(zip(plain, other, strict=False)):
        if a != b:
            return index
    return None


def first_divergence(
    model: PreTrainedModel,
    prompt: Sequence[int],
    plain: Sequence[int],
    other: Sequence[int],
    pass_length: int = 5,
    plain_logits: torch.Tensor | None = None,
) -> Divergence | None:
    """The first divergence of ``other`` from ``plain`` (both generated after ``prompt`` by
    ``model`` greedily), or ``None`` if no token differs.

    ``plain_logits`` (from ``plain_step_logits``) saves recomputing the plain view when one
    plain output is compared with several others. The engine does not record where each
    verification pass started, so the verification view is a pass of ``pass_length`` tokens
    (the verified k plus one) whose first row decides the differing position, after a prefill
    of everything before it, fed the tokens of ``other`` after it (under the causal mask their
    values do not reach that row; only the pass's shape does). Whether the divergence is
    within rounding is judged on the plain view alone, which is exactly what plain decoding
    computed.
    """
    position = first_difference(plain, other)
    if position is None:
        return None
    if plain_logits is None:
        plain_logits = plain_step_logits(model, prompt, plain[: position + 1])
    at = plain_logits[position]
    context = [*prompt, *plain[:position]]
    tail = [*other[position:], *plain[position:]][: max(pass_length - 1, 0)]
    verify = _verification_pass(model, context, tail)
    a, b = plain[position], other[position]
    magnitude = max(abs(float(at[a])), abs(float(at[b])))
    return Divergence(
        position=position,
        plain_token=a,
        other_token=b,
        plain_gap=float(at[a] - at[b]),
        verify_gap=float(verify[a] - verify[b]),
        bound=rounding_bound(magnitude, model.dtype),
        dtype=str(model.dtype).removeprefix("torch."),
    )


def plain_step_logits(
    model: PreTrainedModel, prompt: Sequence[int], plain: Sequence[int]
) -> torch.Tensor:
    """The target's logits before each token of ``plain`` (``[len(plain), vocab]``) as plain
    decoding computes them (the prompt prefilled, then one-token steps)."""
    runner = ModelRunner(model)
    runner.prefill(list(prompt))
    rows = [runner.forward([token])[-1] for token in [prompt[-1], *plain[:-1]]]
    return torch.stack(rows)


def _verification_pass(model: PreTrainedModel, context: list[int], tail: list[int]) -> torch.Tensor:
    """Logits after ``context`` as the first row of a multi-token pass computes them."""
    runner = ModelRunner(model)
    runner.prefill(context)
    return runner.forward([context[-1], *tail])[0]
