"""How often n-gram lookup is right, by the length of its copy so far: the evidence behind
``engine.speculation.adaptive.hint_bucket``.

    python -m bench.ngram_hints [--target DIR] [--max-tokens 128] [--limit 8] [--json FILE]

Generates each built-in prompt's greedy reply with Hugging Face ``generate`` on the target
(bfloat16), then, at every position of the reply, looks up the n-gram match the engine's
proposer would use there (``SuffixIndex``, ``prompt_lookup_min``/``max`` 1 and 4, the
defaults) and counts how many of its next 16 proposed tokens the reply itself continues with:
the run greedy verification would accept (cut short by the reply's end, so S(j) for long j
reads low on short replies). Per workload and hint bucket (the match's
``aligned``, ``hint_bucket``'s powers of two; "no match" where nothing is proposed): the share
of positions and S(j), the share whose run is at least j long. No timing: the figures depend
on the weights and prompts only.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.workload import BUILTIN_DIR, BUILTIN_SETS, load_prompts
from engine.models.loading import load_tokenizer
from engine.speculation.adaptive import hint_bucket
from engine.speculation.proposers.ngram import SuffixIndex, continuation
from engine.training.demo.paths import default_demo_dir

LOOKAHEAD = 16
SHOWN = (1, 2, 4, 8, 16)  # the j of S(j) in the table
BUCKET_NAMES = {0: "no match", 1: "1", 2: "2-3", 3: "4-7", 4: "8-15", 5: "16-31", 6: "32+"}


def runs_by_position(prompt: list[int], reply: list[int]) -> list[tuple[int, int]]:
    """Per position of ``reply``: (the match's ``aligned``, 0 for none; the accepted run)."""
    index = SuffixIndex(1, 4)
    full = prompt + reply
    found = []
    for t in range(len(prompt), len(full)):
        context = full[:t]
        index.follow(context)
        match = index.match()
        if match is None:
            found.append((0, 0))
            continue
        run = 0
        for token, actual in zip(continuation(context, match, LOOKAHEAD), full[t:], strict=False):
            if token != actual:
                break
            run += 1
        found.append((match.aligned, run))
    return found


def table(positions: list[tuple[int, int]]) -> dict[str, dict[str, float]]:
    by_bucket: dict[int, list[int]] = defaultdict(list)
    for aligned, run in positions:
        by_bucket[hint_bucket(aligned) if aligned else 0].append(run)
    return {
        BUCKET_NAMES[bucket]: {
            "share": len(runs) / len(positions),
            **{f"S{j}": sum(r >= j for r in runs) / len(runs) for j in SHOWN},
        }
        for bucket, runs in sorted(by_bucket.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=default_demo_dir() / "target")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=8, help="prompts per workload")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16)
    report: dict[str, dict[str, dict[str, float]]] = {}
    everything: list[tuple[int, int]] = []
    for workload in BUILTIN_SETS:
        prompts = load_prompts(
            BUILTIN_DIR / f"{workload}.jsonl", workload, tokenizer, args.max_tokens, args.limit
        )
        positions: list[tuple[int, int]] = []
        for prompt in prompts:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt.prompt_ids]), max_new_tokens=prompt.max_tokens,
                    do_sample=False,
                )
            ids = list(prompt.prompt_ids)
            positions += runs_by_position(ids, out[0].tolist()[len(ids):])
        report[workload] = table(positions)
        everything += positions
    report["all"] = table(everything)
    for workload, rows in report.items():
        print(f"{workload}:")
        for bucket, row in rows.items():
            figures = "  ".join(f"S{j} {row[f'S{j}']:.2f}" for j in SHOWN)
            print(f"  copy so far {bucket:>8}: {row['share']:4.0%} of positions  {figures}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
