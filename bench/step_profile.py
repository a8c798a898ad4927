"""Where one plain decode step of the engine spends its time, beside Hugging Face ``generate``.

    python -m bench.step_profile [--target DIR] [--dtype bfloat16] [--steps 64]
                                 [--profile-steps 16] [--rounds 3]

Loads the target twice: as the engine serves it (``engine.loading.load_model``, then
``engine.packed_linear.pack_linear_weights`` unless ``--no-pack``), and as a Hugging Face user
would (``from_pretrained`` in the same dtype, its default attention). Prefills a chat prompt
into a ``BatchedRunner`` slot and runs plain decode steps through ``engine.step.run_step``,
the engine's own step (batch 1, greedy). Per round, side by side on the same weights:

- ``engine step``: wall time per ``run_step`` (pass, logits, verification, cache bookkeeping);
- ``model call``: the time inside ``model(...)`` of those steps;
- ``HF generate``: ``model.generate`` greedy per new token, the same number of tokens.

Medians over rounds (rounds alternate, so load drifts hit both alike). Then a torch profiler
table of ``--profile-steps`` engine steps, grouped by operator.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the specgate command does

import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel

from engine.batched_runner import BatchedRunner, Feed
from engine.demo.paths import default_demo_dir
from engine.loading import load_model, load_tokenizer, pick_device
from engine.packed_linear import pack_linear_weights
from engine.proposers.base import Proposal
from engine.step import StepRow, run_step
from engine.types import SamplingParams

PROMPT = "Write a Python function that checks whether a number is prime, with a docstring."


def prompt_ids(target: Path) -> list[int]:
    tokenizer = load_tokenizer(target)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text)["input_ids"])


class ModelTimer:
    """Seconds spent inside the model's forward (pre and post hooks on the top module)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds = 0.0
        self._started = 0.0
        model.register_forward_pre_hook(lambda *_: self._start())
        model.register_forward_hook(lambda *_: self._stop())

    def _start(self) -> None:
        self._started = time.perf_counter()

    def _stop(self) -> None:
        self.seconds += time.perf_counter() - self._started


def engine_steps(model: PreTrainedModel, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Seconds per plain engine step over ``steps`` steps, and the tokens it wrote."""
    runner = BatchedRunner(model, max_slots=1)
    runner.forward([Feed(0, prompt[:-1])], last_only=True)
    context = list(prompt)
    params = SamplingParams(max_tokens=steps, temperature=0.0)
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    for _ in range(steps):
        verdict = run_step(runner, [StepRow(0, context, Proposal([]), params, generator)])[0]
        context.append(verdict.next_token)
    return (time.perf_counter() - started) / steps, context[len(prompt) :]


@torch.inference_mode()
def hf_generate(model: PreTrainedModel, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Seconds per new token of greedy ``generate`` (prefill included, as a user times it),
    and the tokens it wrote."""
    ids = torch.tensor([prompt])
    started = time.perf_counter()
    out = GenerationMixin.generate(
        model,  # type: ignore[arg-type]
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
    )
    seconds = time.perf_counter() - started
    return seconds / steps, out[0, len(prompt) :].tolist()


def profile_table(model: PreTrainedModel, prompt: list[int], steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine_steps(model, prompt, steps)
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, default=default_demo_dir() / "target")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-pack", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()

    model = load_model(args.target, pick_device(None), args.dtype)
    if not args.no_pack:
        pack_linear_weights(model)
    reference = AutoModelForCausalLM.from_pretrained(
        args.target, local_files_only=True, dtype=model.dtype
    ).eval()
    prompt = prompt_ids(args.target)
    timer = ModelTimer(model)
    engine_s, model_s, hf_s = [], [], []
    engine_tokens: list[int] = []
    hf_tokens: list[int] = []
    engine_steps(model, prompt, 4)  # warm-up
    for _ in range(args.rounds):
        timer.seconds = 0.0
        step, engine_tokens = engine_steps(model, prompt, args.steps)
        engine_s.append(step)
        model_s.append(timer.seconds / (args.steps + 1))
        hf, hf_tokens = hf_generate(reference, prompt, args.steps)
        hf_s.append(hf)
    print(f"dtype {model.dtype}, prompt {len(prompt)} tokens, {args.steps} steps, "
          f"{args.rounds} rounds, load {os.getloadavg()[0]:.2f}")
    print(f"engine step   median {statistics.median(engine_s) * 1e3:6.2f} ms "
          f"({1 / statistics.median(engine_s):5.1f} tok/s)  rounds "
          + " ".join(f"{s * 1e3:.1f}" for s in engine_s))
    print(f"  model call  median {statistics.median(model_s) * 1e3:6.2f} ms")
    print(f"HF generate   median {statistics.median(hf_s) * 1e3:6.2f} ms "
          f"({1 / statistics.median(hf_s):5.1f} tok/s)  rounds "
          + " ".join(f"{s * 1e3:.1f}" for s in hf_s))
    pairs = zip(engine_tokens, hf_tokens, strict=True)
    same = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    print("engine and HF tokens " + ("identical" if same is None else f"differ from {same}"))
    if not args.no_profile:
        print(profile_table(model, prompt, args.profile_steps))


if __name__ == "__main__":
    main()
