"""Plain decode steps with the compiled small products against oneDNN's packed ones, side by
side on the same weights.

    python -m bench.small_products [--target DIR] [--dtype float32] [--steps 32] [--rounds 5]
                                   [--batch 1]

Loads the target twice as the engine serves it (``engine.models.loading.load_model``, then
``engine.models.packed_linear.pack_linear_weights``): once with ``engine.kernels.small_gemm`` and
once with it switched off (``SPECGATE_SMALL_GEMM=onednn`` while packing), and alternates
rounds of ``--steps`` plain engine steps (``bench.step_profile.engine_steps``, batch 1,
greedy; with ``--batch N > 1``, ``batched_steps``: N copies of the prompt decoded greedily
in one ``BatchedRunner.forward`` a step) between them, so a change of load hits both alike.
Prints medians (seconds per pass), the ratio of the medians, whether the two wrote the same
tokens, and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the specgate command does

import time

import torch
from transformers import PreTrainedModel

from bench.step_profile import engine_steps, prompt_ids
from engine.kernels import small_gemm
from engine.models.batched_runner import BatchedRunner, Feed
from engine.models.loading import load_model, pick_device
from engine.models.packed_linear import pack_linear_weights
from engine.training.demo.paths import default_demo_dir


@torch.inference_mode()
def batched_steps(
    model: PreTrainedModel, prompt: list[int], steps: int, batch: int
) -> tuple[float, list[int]]:
    """Seconds per greedy decode pass of ``batch`` sequences (prefill not timed), and the
    tokens of every sequence, one after another."""
    runner = BatchedRunner(model, max_slots=batch)
    last = [int(runner.forward([Feed(s, prompt)], last_only=True)[0][-1].argmax())
            for s in range(batch)]
    tokens: list[list[int]] = [[token] for token in last]
    started = time.perf_counter()
    for _ in range(steps):
        logits = runner.forward([Feed(s, [last[s]]) for s in range(batch)])
        last = [int(logits[s][-1].argmax()) for s in range(batch)]
        for s in range(batch):
            tokens[s].append(last[s])
    return (time.perf_counter() - started) / steps, [t for row in tokens for t in row]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, default=default_demo_dir() / "target")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    device = pick_device(None)
    kernel = load_model(args.target, device, args.dtype)
    pack_linear_weights(kernel)
    os.environ["SPECGATE_SMALL_GEMM"] = "onednn"
    small_gemm._built.cache_clear()
    onednn = load_model(args.target, device, args.dtype)
    pack_linear_weights(onednn)
    del os.environ["SPECGATE_SMALL_GEMM"]
    small_gemm._built.cache_clear()
    prompt = prompt_ids(args.target)
    models = {"small_gemm": kernel, "onednn": onednn}
    times: dict[str, list[float]] = {name: [] for name in models}
    tokens: dict[str, list[int]] = {}
    def steps(model: PreTrainedModel, count: int) -> tuple[float, list[int]]:
        if args.batch == 1:
            return engine_steps(model, prompt, count)
        return batched_steps(model, prompt, count, args.batch)

    for model in models.values():
        steps(model, 4)  # warm-up
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for name, model in models.items():
            step, tokens[name] = steps(model, args.steps)
            times[name].append(step)
    loads.append(os.getloadavg()[0])
    medians = {name: statistics.median(seconds) for name, seconds in times.items()}
    print(f"dtype {kernel.dtype}, batch {args.batch}, {args.steps} steps x {args.rounds} rounds, "
          f"load {loads[0]:.2f} -> {loads[1]:.2f}")
    for name, median in medians.items():
        rounds = " ".join(f"{t * 1e3:.1f}" for t in times[name])
        print(f"{name:11s} median {median * 1e3:7.2f} ms/pass ({args.batch / median:5.1f} tok/s)  "
              f"rounds {rounds}")
    print(f"onednn / small_gemm step time: {medians['onednn'] / medians['small_gemm']:.2f}x; "
          "tokens " + ("identical" if tokens["small_gemm"] == tokens["onednn"] else "differ"))


if __name__ == "__main__":
    main()
