"""The engine's plain decode step beside ``torch.compile`` at batch sizes above one.

    python -m bench.compile_batch [--target DIR] [--dtype bfloat16] [--batch 1 4 8]
                                  [--steps 32] [--rounds 3]

Per batch size, the same chat prompt in every row, greedy: seconds per step of the engine's
own step (``engine.serving.step.run_step`` over a ``BatchedRunner`` with a slot per row, as the
scheduler runs a batch) and of Hugging Face's model over a ``StaticCache`` under
``torch.compile`` (``bench.step_profile.CompiledDecode``: one compilation per batch size, timed
once), in turn each round, and whether each row wrote the tokens the batch of one wrote (batch
invariance: the rows are the same request, so any difference is the batch's doing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the specgate command does

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from bench.step_profile import CompiledDecode, prompt_ids
from engine.api.types import SamplingParams
from engine.models.batched_runner import BatchedRunner, Feed
from engine.models.loading import load_model, pick_device
from engine.models.packed_linear import pack_linear_weights
from engine.serving.step import StepRow, run_step
from engine.speculation.proposers.base import Proposal
from engine.training.demo.paths import default_demo_dir


@torch.inference_mode()
def engine_batch(
    model: PreTrainedModel, prompt: list[int], steps: int, batch: int
) -> tuple[float, list[list[int]]]:
    """Seconds per engine step over ``batch`` slots holding ``prompt``, and each row's tokens."""
    runner = BatchedRunner(model, max_slots=batch)
    runner.fill([Feed(slot, prompt[:-1]) for slot in range(batch)])
    contexts = [list(prompt) for _ in range(batch)]
    params = SamplingParams(max_tokens=steps, temperature=0.0)
    generators = [torch.Generator().manual_seed(0) for _ in range(batch)]
    started = time.perf_counter()
    for _ in range(steps):
        rows = [
            StepRow(slot, contexts[slot], Proposal([]), params, generators[slot])
            for slot in range(batch)
        ]
        for context, verdict in zip(contexts, run_step(runner, rows), strict=True):
            context.append(verdict.next_token)
    seconds = (time.perf_counter() - started) / steps
    return seconds, [context[len(prompt) :] for context in contexts]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, default=default_demo_dir() / "target")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = pick_device(None)
    model = load_model(args.target, device, args.dtype)
    pack_linear_weights(model)
    reference = AutoModelForCausalLM.from_pretrained(
        args.target, local_files_only=True, dtype=model.dtype
    ).eval()
    prompt = prompt_ids(args.target)
    alone: dict[str, list[int]] = {}
    print(f"dtype {model.dtype}, torch threads {torch.get_num_threads()}, prompt {len(prompt)} "
          f"tokens, {args.steps} steps, {args.rounds} rounds")  # fmt: skip
    for batch in args.batch:
        compiled = CompiledDecode(reference)  # a compilation of its own per batch size
        started = time.perf_counter()
        compiled.run(prompt, args.steps, batch)  # compiles; sizes the cache
        compile_s = time.perf_counter() - started
        engine_batch(model, prompt, 2, batch)  # warm-up
        times: dict[str, list[float]] = {"engine": [], "compiled": []}
        rows: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            step, rows["engine"] = engine_batch(model, prompt, args.steps, batch)
            times["engine"].append(step)
            step, rows["compiled"] = compiled.run(prompt, args.steps, batch)
            times["compiled"].append(step)
        load = os.getloadavg()[0]
        for key in ("engine", "compiled"):
            median = statistics.median(times[key])
            alone.setdefault(key, rows[key][0])
            invariant = sum(row == alone[key] for row in rows[key])
            extra = f", compiled in {compile_s:.0f} s" if key == "compiled" else ""
            print(f"batch {batch:2d} {key:8s} {median * 1e3:7.2f} ms/step "
                  f"({batch / median:6.1f} tok/s), rows as batch 1: {invariant}/{batch}, "
                  f"load {load:.2f}{extra}")  # fmt: skip


if __name__ == "__main__":
    main()
