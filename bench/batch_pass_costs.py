"""The target's batched pass cost by batch size and width, and the speculation crossover it
implies.

    python -m bench.batch_pass_costs [--target DIR] [--dtype bfloat16] [--batches 1,2,4,8,16]
                                     [--widths 1,2,3,4,5] [--context 64] [--alpha 0.3,0.5,0.7]
                                     [--json FILE] [--compare-lean STEPS]
                                     [--compare-attention STEPS] [--micro-contexts 200,400,800]

The target is loaded as the engine serves it (``engine.models.loading.load_model``, then
``engine.models.packed_linear.pack_linear_weights``). Every slot of a ``BatchedRunner`` holds
``--context`` cached tokens; a pass feeds each of
``batch`` sequences ``width`` rows (its last token and ``width - 1`` proposal rows). The
fastest of a few passes per point is kept (noise on shared cores only ever adds time). Those
figures go into ``StepCosts`` as if the engine had measured them, and for each acceptance rate
``--alpha`` (a steady per-token rate) the report gives the proposal length a batch of such
sequences chooses at each batch size and the crossover: the smallest batch size where it
chooses plain steps (``engine.speculation.batch_speculation.crossover``, the figure ``/metrics``
exports).

``--compare-lean STEPS`` instead times plain steps (one row per sequence, slot ``s`` holding
``--context + 30 s`` cached tokens) of the engine's lean forward (``engine.models.lean_llama``) and
of HF's modules over the same packed model, alternating pass by pass, STEPS of each per
batch size: medians of wall and process CPU time, and whether their logits were equal.

``--compare-attention STEPS`` first times one layer's decode attention alone (the target's
heads, KV heads and head size; one query row per sequence, sequence ``s`` of ``--micro-
contexts`` + ``5 s mod 35`` positions, in a float32 arena as the slot cache keeps it): the
compiled kernel (``engine.kernels.decode_attention``, one call for the batch) against
PyTorch's SDPA per sequence (the fallback), alternating call by call, medians. Then plain
steps of the served runner with the kernel and with SDPA (two runners over the same model,
alternating pass by pass, as ``--compare-lean``), with the largest logit difference and
whether the greedy tokens agree (the two attend in different summation orders).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from engine.kernels import decode_attention
from engine.models.attention import _attend_each_sequence
from engine.models.batched_runner import BatchedRunner, Feed
from engine.models.loading import load_model, pick_device
from engine.models.packed_linear import pack_linear_weights
from engine.speculation.adaptive import Candidate, PassCosts, best_length
from engine.speculation.batch_speculation import StepCosts
from engine.training.demo.paths import default_demo_dir

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


Variant = tuple[BatchedRunner, Callable[[], AbstractContextManager[None]]]


def alternate_steps(
    variants: dict[str, Variant], batches: list[int], context: int, steps: int
) -> list[dict[str, object]]:
    """Plain step medians of each variant (a runner and the context its passes run in),
    alternating pass by pass: slot ``s`` holds ``context + 30 s`` cached tokens."""
    for runner, within in variants.values():
        for slot in range(max(batches)):
            prompt = [3 + (i * 7 + slot) % 500 for i in range(context + 30 * slot)]
            with within():
                runner.forward([Feed(slot, prompt)], last_only=True)
    rows = []
    for batch in batches:
        wall: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        equal = greedy_equal = True
        largest = 0.0
        for step in range(steps + 1):  # the first round warms up
            logits = []
            for name, (runner, within) in variants.items():
                feeds = [Feed(slot, [11 + slot]) for slot in range(batch)]
                with within():
                    started, used = time.perf_counter(), time.process_time()
                    logits.append(runner.forward(feeds))
                    if step:
                        wall[name].append(time.perf_counter() - started)
                        cpu[name].append(time.process_time() - used)
                for slot in range(batch):
                    runner.truncate(slot, runner.lengths[slot] - 1)
            for a, b in zip(*logits, strict=True):
                equal &= torch.equal(a, b)
                greedy_equal &= torch.equal(a.argmax(-1), b.argmax(-1))
                largest = max(largest, (a - b).abs().max().item())
        row: dict[str, object] = {
            "batch": batch, "logits_equal": equal, "greedy_equal": greedy_equal,
            "max_logit_diff": largest,
        }
        for name in variants:
            row[f"{name}_wall_ms"] = round(statistics.median(wall[name]) * 1e3, 1)
            row[f"{name}_cpu_ms"] = round(statistics.median(cpu[name]) * 1e3, 1)
        row["load_average_1m"] = round(os.getloadavg()[0], 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def lean_comparison(
    model: torch.nn.Module, batches: list[int], context: int, steps: int
) -> list[dict[str, object]]:
    """Plain step medians of the lean forward against HF's modules, alternating."""
    return alternate_steps(
        {
            "lean": (BatchedRunner(model, max(batches)), nullcontext),  # type: ignore[arg-type]
            "hf_modules": (
                BatchedRunner(model, max(batches), lean=False),  # type: ignore[arg-type]
                nullcontext,
            ),
        },
        batches, context, steps,
    )


def attention_micro(
    model: torch.nn.Module, batches: list[int], contexts: list[int], calls: int
) -> list[dict[str, object]]:
    """One layer's decode attention: the kernel's one call against SDPA per sequence."""
    config = model.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    scale = dim**-0.5
    rows = []
    generator = torch.Generator().manual_seed(0)
    for batch in batches:
        for context in contexts:
            spans = [(s * (context + 64), context + (5 * s) % 35) for s in range(batch)]
            shape = (1, kv_heads, batch * (context + 64), dim)
            keys = torch.randn(shape, generator=generator)
            values = torch.randn(shape, generator=generator)
            query = torch.randn((batch, heads, 1, dim), generator=generator)
            times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
            for call in range(calls + 3):  # three warm-up rounds
                started = time.perf_counter()
                decode_attention.attend(query, keys, values, None, spans, scale)
                middle = time.perf_counter()
                _attend_each_sequence(query, keys, values, None, spans, scale)
                if call >= 3:
                    times["kernel"].append(middle - started)
                    times["sdpa"].append(time.perf_counter() - middle)
            row: dict[str, object] = {"batch": batch, "positions": context}
            for name, spent in times.items():
                row[f"{name}_us"] = round(statistics.median(spent) * 1e6, 1)
            row["sdpa_over_kernel"] = round(
                statistics.median(times["sdpa"]) / statistics.median(times["kernel"]), 2
            )
            row["load_average_1m"] = round(os.getloadavg()[0], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def attention_comparison(
    model: torch.nn.Module, batches: list[int], context: int, contexts: list[int], steps: int
) -> None:
    if not decode_attention.available():
        raise SystemExit(f"no decode attention kernel: {decode_attention.status()}")
    attention_micro(model, batches, contexts, 50)
    alternate_steps(
        {
            "kernel": (BatchedRunner(model, max(batches)), nullcontext),  # type: ignore[arg-type]
            "sdpa": (
                BatchedRunner(model, max(batches)),  # type: ignore[arg-type]
                decode_attention.switched_off,
            ),
        },
        batches, context, steps,
    )


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
    parser.add_argument("--compare-attention", type=int, metavar="STEPS")
    parser.add_argument("--micro-contexts", default="200,400,800")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    widths = [int(w) for w in args.widths.split(",")]

    model = load_model(args.target, pick_device(None), args.dtype)
    pack_linear_weights(model)  # as the engine serves its target
    if args.compare_lean:
        lean_comparison(model, batches, args.context, args.compare_lean)
        return
    if args.compare_attention:
        contexts = [int(c) for c in args.micro_contexts.split(",")]
        attention_comparison(model, batches, args.context, contexts, args.compare_attention)
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
            steps.record(batch, batch * width, seconds)
            print(json.dumps({"batch": batch, "width": width, "ms": grid[batch][width]}))
    choices: dict[str, dict[int, int]] = {}
    crossovers: dict[str, float | str] = {}
    max_k = max(widths) - 1
    for alpha in (float(a) for a in args.alpha.split(",")):
        survival = [alpha**j for j in range(1, max_k + 1)]
        candidate = Candidate(survival, 0.0, max_k)
        chosen = {
            batch: best_length([candidate] * batch, lambda r, b=batch: steps.seconds(b, r))
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
