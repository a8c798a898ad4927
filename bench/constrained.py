"""Constrained decoding's cost: tokens/s under a JSON grammar against the same requests
unconstrained, for plain decoding and each speculation method, measured side by side.

The constrained requests ask for ``json_object`` output (grammar mask on every target row,
and on the draft's rows before it draws); the unconstrained ones are the same prompts and
budget. Runs alternate per prompt so that load on shared cores falls on both alike. The
ratio is the figure to read: what the mask and matcher cost per token, speculation included.

``specgate bench`` appends these lines to its report; ``python -m bench.constrained`` measures
them alone (the json prompt set), with the load average before and after, for a machine
where the whole benchmark would take too long.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.workload import BenchPrompt
from engine.api.types import (
    Constraint,
    GenerationRequest,
    Method,
    SamplingParams,
    SpeculativeChoice,
)
from engine.serving.service import Engine

JSON_OBJECT = Constraint("json_object", "{}")


@dataclass(frozen=True)
class ConstrainedLine:
    """Medians of decode rates (tokens after the first over the time after the first, so that
    prefill and outputs of different lengths do not weigh in) and mean output lengths."""

    method: Method
    k: int | None
    unconstrained_tps: float
    constrained_tps: float
    unconstrained_tokens: float = 0.0
    constrained_tokens: float = 0.0

    @property
    def ratio(self) -> float:
        return self.constrained_tps / self.unconstrained_tps if self.unconstrained_tps else 0.0

    def text(self) -> str:
        label = "none" if self.method == "none" else f"{self.method} k={self.k}"
        return (
            f"constrained decoding (json_object), {label}: {self.constrained_tps:.1f} tok/s vs "
            f"{self.unconstrained_tps:.1f} unconstrained ({self.ratio:.2f}x), median decode "
            f"rate after the first token; {self.constrained_tokens:.0f} vs "
            f"{self.unconstrained_tokens:.0f} tokens per output"
        )


def _decode_rate(
    engine: Engine, prompt: BenchPrompt, method: Method, k: int | None, constrained: bool
) -> tuple[float, int]:
    """(tokens per second after the first token, tokens generated) for one greedy run."""
    params = SamplingParams(
        max_tokens=prompt.max_tokens,
        temperature=0.0,
        constraint=JSON_OBJECT if constrained else None,
    )
    request = GenerationRequest(prompt.prompt_ids, params, SpeculativeChoice(method, k))
    result = engine.generate(request)
    tokens = len(result.token_ids)
    stats = result.stats
    seconds = stats.total_time_s - stats.time_to_first_token_s
    return ((tokens - 1) / seconds if tokens > 1 and seconds > 0 else 0.0), tokens


def measure(
    engine: Engine, prompts: Sequence[BenchPrompt], repeats: int, k: int
) -> list[ConstrainedLine]:
    engine.compile_constraint(JSON_OBJECT)  # the token table is built once, not timed
    lines = []
    for method in engine.available_methods:
        fixed = None if method == "none" else k
        rates: dict[bool, list[float]] = {False: [], True: []}
        lengths: dict[bool, list[int]] = {False: [], True: []}
        for repeat in range(repeats):
            for index, prompt in enumerate(prompts):
                order = (False, True) if (repeat + index) % 2 == 0 else (True, False)
                for constrained in order:
                    rate, tokens = _decode_rate(engine, prompt, method, fixed, constrained)
                    rates[constrained].append(rate)
                    lengths[constrained].append(tokens)
        lines.append(
            ConstrainedLine(
                method,
                fixed,
                statistics.median(rates[False]),
                statistics.median(rates[True]),
                statistics.mean(lengths[False]),
                statistics.mean(lengths[True]),
            )
        )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    from bench.runner import BenchSetup, load_engine
    from bench.workload import builtin_prompts
    from engine.training.demo.paths import default_demo_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=default_demo_dir() / "target")
    parser.add_argument("--draft", type=Path, default=None)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--limit", type=int, default=4, help="json prompts to take")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args(argv)
    setup = BenchSetup(args.target, args.draft, args.repeats, args.k)
    engine = load_engine(setup)
    try:
        prompts = builtin_prompts(engine.tokenizer, args.max_tokens, args.limit)
        json_prompts = [p for p in prompts if p.workload == "json"]
        before = os.getloadavg()[0]
        lines = measure(engine, json_prompts, args.repeats, args.k)
        after = os.getloadavg()[0]
    finally:
        engine.close()
    for line in lines:
        print(line.text())
    print(f"load average (1 min): {before:.2f} before, {after:.2f} after")


if __name__ == "__main__":
    main()
