"""The target's batched pass cost by batch size and width, and the speculation crossover it
implies.

    python -m bench.batch_pass_costs [--target DIR] [--dtype bfloat16] [--batches 1,2,4,8,16]
                                     [--widths 1,2,3,4,5] [--context 64] [--alpha 0.3,0.5,0.7]
                                     [--json FILE] [--compare-lean STEPS]

The target is loaded as the engine serves it (``engine.loading.load_model``, then
``engine.packed_linear.pack_linear_weights``). Every slot of a ``BatchedRunner`` holds
``--context`` cached tokens; a pass feeds each of
``batch`` sequences ``width`` rows (its last token and ``width - 1`` proposal rows). The
fastest of a few passes per point is kept (noise on shared cores only ever adds time). Those
figures go into ``StepCosts`` as if the engine had measured them, and for each acceptance rate
``--alpha`` (a steady per-token rate) the report gives the proposal length a batch of such
sequences chooses at each batch size and the crossover: the smallest batch size where it
chooses plain steps (``engine.batch_speculation.crossover``, the figure ``/metrics`` exports).

``--compare-lean STEPS`` instead times plain steps (one row per sequence, slot ``s`` holding
``--context + 30 s`` cached tokens) of the engine's lean forward (``engine.lean_llama``) and
of HF's modules over the same packed model, alternating pass by pass, STEPS of each per
batch size: medians of wall and process CPU time, and whether their logits were equal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def lean_comparison(
    model: torch.nn.Module, batches: list[int], context: int, steps: int
) -> list[dict[str, object]]:
    """Plain step medians of the lean forward against HF's modules, alternating."""
    runners = {
        "lean": BatchedRunner(model, max(batches)),  # type: ignore[arg-type]
        "hf_modules": BatchedRunner(model, max(batches), lean=False),  # type: ignore[arg-type]
    }
    for runner in runners.values():
        for slot in range(max(batches)):
            prompt = [3 + (i * 7 + slot) % 500 for i in range(context + 30 * slot)]
            runner.forward([Feed(slot, prompt)], last_only=True)
    rows = []
    for batch in batches:
        wall: dict[str, list[float]] = {name: [] for name in runners}
        cpu: dict[str, list[float]] = {name: [] for name in runners}
        equal = True
        for step in range(steps + 1):  # the first round warms up
            logits = []
            for name, runner in runners.items():
                feeds = [Feed(slot, [11 + slot]) for slot in range(batch)]
                started, used = time.perf_counter(), time.process_time()
                logits.append(runner.forward(feeds))
                if step:
                    wall[name].append(time.perf_counter() - started)
                    cpu[name].append(time.process_time() - used)
                for slot in range(batch):
                    runner.truncate(slot, runner.lengths[slot] - 1)
            equal &= all(torch.equal(a, b) for a, b in zip(*logits, strict=True))
        row: dict[str, object] = {"batch": batch, "logits_equal": equal}
        for name in runners:
            row[f"{name}_wall_ms"] = round(statistics.median(wall[name]) * 1e3, 1)
            row[f"{name}_cpu_ms"] = round(statistics.median(cpu[name]) * 1e3, 1)
        row["load_average_1m"] = round(os.getloadavg()[0], 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


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
    parser.add_argument("--compare-lean", type=int, metavar="STEPS")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    widths = [int(w) for w in args.widths.split(",")]

    model = load_model(args.target, pick_device(None), args.dtype)
    pack_linear_weights(model)  # as the engine serves its target
    if args.compare_lean:
        lean_comparison(model, batches, args.context, args.compare_lean)
        return
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
