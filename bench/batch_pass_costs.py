"""The target's batched pass cost by batch size and width, and the speculation crossover it
implies.

    python -m bench.batch_pass_costs [--target DIR] [--dtype bfloat16] [--batches 1,2,4,8,16]
                                     [--widths 1,2,3,4,5] [--context 64] [--alpha 0.3,0.5,0.7]
                                     [--json FILE]

The target is loaded as the engine serves it (``engine.loading.load_model``, then
``engine.packed_linear.pack_linear_weights``). Every slot of a ``BatchedRunner`` holds
``--context`` cached tokens; a pass feeds each of
``batch`` sequences ``width`` rows (its last token and ``width - 1`` proposal rows). The
fastest of a few passes per point is kept (noise on shared cores only ever adds time). Those
figures go into ``StepCosts`` as if the engine had measured them, and for each acceptance rate
``--alpha`` (a steady per-token rate) the report gives the proposal length a batch of such
sequences chooses at each batch size and the crossover: the smallest batch size where it
chooses plain steps (``engine.batch_speculation.crossover``, the figure ``/metrics`` exports).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from engine.adaptive import Candidate, PassCosts, best_length
from engine.batch_speculation import StepCosts
from engine.batched_runner import BatchedRunner, Feed
from engine.demo.paths import default_demo_dir
from engine.loading import load_model, pick_device
from engine.packed_linear import pack_linear_weights

REPEATS = 5


def pass_seconds(runner: BatchedRunner, batch: int, width: int, context: int) -> float:
    times = []
    for _ in range(REPEATS + 1):  # the first pass warms up
        feeds = [Feed(slot, [7 + slot] * width) for slot in range(batch)]
        started = time.perf_counter()
        runner.forward(feeds)
        times.append(time.perf_counter() - started)
        for slot in range(batch):
            runner.truncate(slot, context)
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, default=default_demo_dir() / "target")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--widths", default="1,2,3,4,5")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--alpha", default="0.3,0.5,0.7")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    widths = [int(w) for w in args.widths.split(",")]

    model = load_model(args.target, pick_device(None), args.dtype)
    pack_linear_weights(model)  # as the engine serves its target
    runner = BatchedRunner(model, max(batches))
    for slot in range(max(batches)):
        runner.forward([Feed(slot, [3 + (i * 7 + slot) % 500 for i in range(args.context)])])
    grid: dict[int, dict[int, float]] = {}
    steps = StepCosts(PassCosts())
    for batch in batches:
        grid[batch] = {}
        for width in widths:
            seconds = pass_seconds(runner, batch, width, args.context)
            grid[batch][width] = round(seconds * 1000, 2)
            steps.record(batch, width, seconds)
            print(json.dumps({"batch": batch, "width": width, "ms": grid[batch][width]}))
    choices: dict[str, dict[int, int]] = {}
    crossovers: dict[str, float | str] = {}
    max_k = max(widths) - 1
    for alpha in (float(a) for a in args.alpha.split(",")):
        survival = [alpha**j for j in range(1, max_k + 1)]
        candidate = Candidate(survival, 0.0, max_k)
        chosen = {
            batch: best_length([candidate] * batch, lambda w, b=batch: steps.seconds(b, w))
            for batch in batches
        }
        choices[str(alpha)] = chosen
        plain_at = [batch for batch in batches if chosen[batch] == 0]
        crossovers[str(alpha)] = plain_at[0] if plain_at else "inf"
    result = {
        "dtype": args.dtype,
        "context_tokens": args.context,
        "pass_ms": grid,
        "chosen_k_by_batch": choices,
        "crossover_batch_size": crossovers,
        "note": "crossover among the measured batch sizes; n-gram proposals cost ~0",
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
