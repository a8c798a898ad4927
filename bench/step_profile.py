"""Where one plain decode step of the engine spends its time, beside Hugging Face ``generate``.

    python -m bench.step_profile [--target DIR] [--dtype bfloat16] [--steps 64] [--rounds 3]
                                 [--threads N] [--clock wall|cpu] [--profile-steps 16]
                                 [--no-profile]

Loads the target three times: as the engine serves it (``engine.models.loading.load_model``, then
``engine.models.packed_linear.pack_linear_weights``), the same without the packing, and as a Hugging
Face user would (``from_pretrained`` in the same dtype, its default attention). Prefills a
chat prompt into a ``BatchedRunner`` slot and runs plain decode steps through
``engine.serving.step.run_step``, the engine's own step (batch 1, greedy). Per round, side by side
on the same weights, in turn:

- ``engine step``: wall time per ``run_step`` (pass, logits, verification, cache bookkeeping)
  on the packed model, and ``model call``, the part of it inside ``model(...)``;
- ``engine step, unpacked``: the same on the model as loaded;
- ``HF generate``: ``model.generate`` greedy, seconds per new token (prefill included, as a
  user times it; the prompt is short), the same number of tokens;
- with ``--compiled``, ``HF compiled``: the Hugging Face model's one-token forward over a
  ``StaticCache`` under ``torch.compile`` (inductor), gpt-fast's shape of a decode step,
  seconds per step after a compilation timed once before the rounds.

Medians over rounds (each round runs all three, so load drifts hit them alike). On CUDA the
clock reads after the device has finished, and the engine step is set against the bandwidth
bound: the weights' bytes over the device's measured copy bandwidth. Then a torch
profiler table of ``--profile-steps`` packed engine steps (prefill excluded), by operator.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the specgate command does

import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel, StaticCache

from engine.api.types import SamplingParams
from engine.models.batched_runner import BatchedRunner, Feed
from engine.models.loading import load_model, load_tokenizer, pick_device
from engine.models.packed_linear import pack_linear_weights
from engine.serving.step import StepRow, run_step
from engine.speculation.proposers.base import Proposal
from engine.training.demo.paths import default_demo_dir

# ``--clock cpu`` times with the process's CPU time (all threads; OpenMP threads wait
# passively), which other processes on shared cores inflate far less than wall time.
_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter
_device = torch.device("cpu")


def _now() -> float:
    """The clock, once the device has finished what was queued (CUDA runs asynchronously)."""
    if _device.type == "cuda":
        torch.cuda.synchronize(_device)
    return _clock()


def bandwidth_bound_s(model: PreTrainedModel) -> float:
    """Seconds per token of plain decoding if reading every weight once per token at the
    device's copy bandwidth (a device-to-device copy of 1 GiB, bytes read and written) were
    all it cost: the bound the step's time is compared with on a GPU."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device=_device)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up
    started = _now()
    for _ in range(5):
        target.copy_(source)
    bandwidth = 2 * source.numel() * 5 / (_now() - started)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights / bandwidth

PROMPT = "Write a Python function that checks whether a number is prime, with a docstring."


def prompt_ids(target: Path) -> list[int]:
    tokenizer = load_tokenizer(target)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text)["input_ids"])


class ModelTimer:
    """Seconds of each call of the model's forward (hooks on the top module)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[float] = []
        self._started = 0.0
        model.register_forward_pre_hook(lambda *_: self._start())
        model.register_forward_hook(lambda *_: self._stop())

    def _start(self) -> None:
        self._started = _now()

    def _stop(self) -> None:
        self.calls.append(_now() - self._started)


def engine_steps(
    model: PreTrainedModel,
    prompt: list[int],
    steps: int,
    around: contextlib.AbstractContextManager[object] | None = None,
) -> tuple[float, list[int]]:
    """Seconds per plain engine step over ``steps`` steps (run inside ``around``; the prefill
    before them is not), and the tokens it wrote."""
    runner = BatchedRunner(model, max_slots=1)
    runner.forward([Feed(0, prompt[:-1])], last_only=True)
    context = list(prompt)
    params = SamplingParams(max_tokens=steps, temperature=0.0)
    generator = torch.Generator().manual_seed(0)
    with around or contextlib.nullcontext():
        started = _now()
        for _ in range(steps):
            row = StepRow(0, context, Proposal([]), params, generator)
            context.append(run_step(runner, [row])[0].next_token)
        seconds = _now() - started
    return seconds / steps, context[len(prompt) :]


@torch.inference_mode()
def hf_generate(model: PreTrainedModel, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Seconds per new token of greedy ``generate`` (prefill included, as a user times it),
    and the tokens it wrote."""
    ids = torch.tensor([prompt], device=model.device)
    started = _now()
    out = GenerationMixin.generate(
        model,
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
    )
    seconds = _now() - started
    return seconds / steps, out[0, len(prompt) :].tolist()


class CompiledDecode:
    """Greedy decoding with the model's one-token forward over a ``StaticCache`` compiled by
    ``torch.compile`` (static shapes: one compilation serves every step)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache: StaticCache | None = None
        self.step = torch.compile(self._forward, dynamic=False)

    def _forward(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=token, past_key_values=self.cache, cache_position=position, use_cache=True
        )
        return out.logits[:, -1]

    @torch.inference_mode()
    def run(self, prompt: list[int], steps: int, batch: int = 1) -> tuple[float, list[list[int]]]:
        """Seconds per step over ``steps`` steps after an eager prefill, ``batch`` copies of
        ``prompt`` side by side, and each row's tokens. The cache is made once and reset
        after (a new cache object would be a recompilation), so the first run's ``prompt``,
        ``steps`` and ``batch`` bound the later ones'."""
        if self.cache is None:
            length = len(prompt) + steps + 1
            self.cache = StaticCache(config=self.model.config, max_cache_len=length)
        else:
            self.cache.reset()
        device = self.model.device
        ids = torch.tensor([prompt] * batch, device=device)
        out = self.model(
            input_ids=ids, past_key_values=self.cache,
            cache_position=torch.arange(len(prompt), device=device), use_cache=True,
        )
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        written = [token[:, 0].tolist()]
        started = _now()
        for i in range(steps):
            logits = self.step(token, torch.tensor([len(prompt) + i], device=device))
            token = logits.argmax(-1, keepdim=True)
            written.append(token[:, 0].tolist())  # read every step, as a server streams
        seconds = (_now() - started) / steps
        return seconds, [list(row) for row in zip(*written[:steps], strict=True)]


def profile_table(model: PreTrainedModel, prompt: list[int], steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    engine_steps(model, prompt, steps, around=prof)
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
    parser.add_argument("--threads", type=int)
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="wall")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument(
        "--compiled", action="store_true", help="also torch.compile'd HF decode over a StaticCache"
    )
    args = parser.parse_args()

    global _clock, _device
    _clock = _CLOCKS[args.clock]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = _device = pick_device(None)
    model = load_model(args.target, device, args.dtype)
    pack_linear_weights(model)
    unpacked = load_model(args.target, device, args.dtype)
    reference = AutoModelForCausalLM.from_pretrained(
        args.target, local_files_only=True, dtype=model.dtype
    ).eval()
    prompt = prompt_ids(args.target)
    timer = ModelTimer(model)
    times: dict[str, list[float]] = {"engine": [], "model": [], "unpacked": [], "hf": []}
    tokens: dict[str, list[int]] = {}
    engine_steps(model, prompt, 4)  # warm-up
    compiled = CompiledDecode(reference) if args.compiled else None
    if compiled is not None:
        started = time.perf_counter()
        compiled.run(prompt, args.steps)  # compiles; sizes the cache
        print(f"torch.compile of the decode step: {time.perf_counter() - started:.1f} s")
        times["compiled"] = []
    for _ in range(args.rounds):
        timer.calls.clear()
        step, tokens["engine"] = engine_steps(model, prompt, args.steps)
        times["engine"].append(step)
        times["model"].append(statistics.median(timer.calls))  # the prefill call is one
        step, tokens["unpacked"] = engine_steps(unpacked, prompt, args.steps)
        times["unpacked"].append(step)
        step, tokens["hf"] = hf_generate(reference, prompt, args.steps)
        times["hf"].append(step)
        if compiled is not None:
            step, (tokens["compiled"],) = compiled.run(prompt, args.steps)
            times["compiled"].append(step)
    print(f"{args.clock} clock, dtype {model.dtype}, torch threads {torch.get_num_threads()}, "
          f"prompt {len(prompt)} tokens, {args.steps} steps, {args.rounds} rounds, "
          f"load {os.getloadavg()[0]:.2f}")
    labels = {"engine": "engine step", "model": "  model call", "unpacked": "engine unpacked",
              "hf": "HF generate", "compiled": "HF compiled"}
    labels = {key: label for key, label in labels.items() if key in times}
    for key, label in labels.items():
        median = statistics.median(times[key])
        rounds = " ".join(f"{t * 1e3:.1f}" for t in times[key])
        print(f"{label:16s} median {median * 1e3:7.2f} ms ({1 / median:5.1f} tok/s)  "
              f"rounds {rounds}")
    if device.type == "cuda":
        bound = bandwidth_bound_s(model)
        engine = statistics.median(times["engine"])
        print(f"bandwidth bound  {bound * 1e3:7.2f} ms per token (the weights read once at the "
              f"copy bandwidth); the engine step takes {engine / bound:.2f}x of it")
    for key in [key for key in ("unpacked", "hf", "compiled") if key in tokens]:
        pairs = zip(tokens["engine"], tokens[key], strict=True)
        same = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        print(f"engine and {labels[key]} tokens "
              + ("identical" if same is None else f"differ from token {same}"))
    if not args.no_profile:
        print(profile_table(model, prompt, args.profile_steps))


if __name__ == "__main__":
    main()
