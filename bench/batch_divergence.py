"""How often a greedy request decoded in a shared batch differs from the same request alone,
and at which logit gap.

    python -m bench.batch_divergence [--target DIR] [--dtype bfloat16] [--max-tokens 48]
                                     [--copies 2] [--batch-invariant] [--json FILE]

Decodes every built-in chat prompt (``--copies`` times over, so the batch is wider than the
mix) plain and greedy, first one at a time, then all at once in one batch, through the
engine. Where a request's two outputs differ, the first differing position is reported with
the target's top-two logit gap there as plain decoding computes it, against the widest gap
the dtype's rounding can invert (``engine.speculation.divergence.rounding_bound``): a gap within it
is a floating-point near-tie (batched kernels reduce in another order), a wider one a bug.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from bench.concurrency import chat_mix
from engine.api.types import GenerationRequest, SamplingParams, SpeculativeChoice
from engine.config import EngineConfig
from engine.serving.service import Engine
from engine.speculation.divergence import first_difference, plain_step_logits, rounding_bound
from engine.training.demo.paths import default_demo_dir


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, default=default_demo_dir() / "target")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    config = EngineConfig(
        target=args.target, dtype=args.dtype, max_num_seqs=16, batch_invariant=args.batch_invariant
    )
    engine = Engine.load(config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    prompts = [
        tuple(
            engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for messages in chat_mix()
    ] * args.copies
    requests = [GenerationRequest(p, params, SpeculativeChoice("none")) for p in prompts]
    try:
        alone = [engine.generate(request).token_ids for request in requests]
        handles = [engine.submit(request) for request in requests]
        batched = [handle.result().token_ids for handle in handles]
        differences = []
        compared = 0
        for prompt, one, many in zip(prompts, alone, batched, strict=True):
            position = first_difference(one, many)
            compared += min(len(one), len(many)) if position is None else position + 1
            if position is None:
                continue
            logits = plain_step_logits(engine.target_model, prompt, one[: position + 1])[-1]
            mine, other = float(logits[one[position]]), float(logits[many[position]])
            bound = rounding_bound(max(abs(mine), abs(other)), engine.target_dtype)
            differences.append(
                {
                    "position": position,
                    "plain_gap": round(mine - other, 5),
                    "rounding_bound": round(bound, 5),
                    "near_tie": mine - other <= bound,
                }
            )
    finally:
        engine.close()
    result = {
        "dtype": args.dtype,
        "batch_invariant": args.batch_invariant,
        "requests": len(requests),
        "batch_size": len(requests),
        "tokens_compared": compared,
        "requests_differing": len(differences),
        "differences": differences,
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
