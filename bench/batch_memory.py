"""KV cache memory of a batch with one long prompt among short ones, and its pass time.

    python -m bench.batch_memory [--target DIR] [--dtype bfloat16] [--slots 16]
                                 [--long-tokens 2000] [--short-tokens 80] [--max-tokens 32]
                                 [--json FILE]

One slot of a ``BatchedRunner`` prefills a ``--long-tokens`` prompt, the other ``--slots - 1``
prompts of ``--short-tokens``; each slot is reserved what the scheduler reserves for its
request (``engine.serving.scheduler.reservation``: prompt + ``--max-tokens`` + one step's rows). The
report gives the cache's allocated positions and MiB (keys and values, every layer), what
the short slots hold, and the fastest of a few plain decode passes over every slot and over
the short slots only (noise on shared cores only ever adds time).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from engine.models.batched_runner import BatchedRunner, Feed
from engine.models.loading import load_model, pick_device
from engine.serving.scheduler import reservation
from engine.training.demo.paths import default_demo_dir

REPEATS = 5
CHUNK = 128


def decode_seconds(runner: BatchedRunner, slots: list[int]) -> float:
    times = []
    for _ in range(REPEATS + 1):  # the first pass warms up
        lengths = [runner.lengths[slot] for slot in slots]
        started = time.perf_counter()
        runner.forward([Feed(slot, [11]) for slot in slots])
        times.append(time.perf_counter() - started)
        for slot, length in zip(slots, lengths, strict=True):
            runner.truncate(slot, length)
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, default=default_demo_dir() / "target")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--short-tokens", type=int, default=80)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    model = load_model(args.target, pick_device(None), args.dtype)
    runner = BatchedRunner(model, args.slots)
    prompts = [args.long_tokens] + [args.short_tokens] * (args.slots - 1)
    for slot, size in enumerate(prompts):
        runner.reserve(slot, reservation(size, args.max_tokens))
        tokens = [3 + (i * 7 + slot) % 500 for i in range(size)]
        for start in range(0, size, CHUNK):
            runner.forward([Feed(slot, tokens[start : start + CHUNK])], last_only=True)
    config = model.config
    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_hidden_layers * heads * dim * model.dtype.itemsize
    cache = runner.cache
    allocated = cache.allocated_positions()
    result = {
        "dtype": args.dtype,
        "slots": args.slots,
        "prompt_tokens": {"long": args.long_tokens, "short": args.short_tokens},
        "allocated_positions": allocated,
        "allocated_mib": round(allocated * per_position / 2**20, 1),
        "short_slot_positions": cache.capacity(1),
        "long_slot_positions": cache.capacity(0),
        "bytes_per_position": per_position,
        "decode_pass_ms_all_slots": round(decode_seconds(runner, list(range(args.slots))) * 1e3, 2),
        "decode_pass_ms_short_slots": round(
            decode_seconds(runner, list(range(1, args.slots))) * 1e3, 2
        ),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
