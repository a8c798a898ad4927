"""Medusa's static tree from its heads' measured rank accuracies, on held-out answers.

The target answers demo distillation prompts its heads were not trained on (from
``--first``, past the README's 640), each head's accuracy at every top-k rank is measured on
those answers (``medusa_rank_accuracy``), and the sparse tree they choose
(``sparse_tree``) is printed with its expected tokens per step at each size, beside the
built-in tree's::

    python -m bench.medusa_tree --target ~/.cache/specgate/demo/target \
        --heads ~/.cache/specgate/demo/medusa --sizes 16,24,32
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from engine.models.loading import load_model, load_tokenizer
from engine.models.versioning import model_version
from engine.speculation.proposers.medusa import (
    DEFAULT_MEDUSA_TREE,
    sparse_tree,
    tree_expected_tokens,
)
from engine.training.heads.data import distillation_data
from engine.training.heads.loading import medusa_for
from engine.training.heads.train import HeadsSpec, demo_chats, medusa_rank_accuracy


def _quiet(_phase: str, _done: int, _total: int, _loss: float) -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--heads", type=Path, required=True)
    parser.add_argument("--first", type=int, default=640, help="first held-out prompt")
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts answered")
    parser.add_argument("--ranks", type=int, default=8, help="top-k ranks measured per head")
    parser.add_argument("--sizes", default="16,24,32", help="tree sizes to print")
    parser.add_argument("--cache", type=Path, default=None, help="answer cache directory")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.target)
    target = load_model(args.target, torch.device("cpu"), "float32")
    version = model_version(args.target)
    heads = medusa_for(args.heads, target, version)
    chats = demo_chats(args.first + args.prompts, 0)[args.first :]
    spec = HeadsSpec(snippets=0, answer_tokens=128, generation_batch=64)
    data = distillation_data(
        target, tokenizer, version, spec.data(), _quiet, chats=chats, cache_dir=args.cache
    )
    accuracy = medusa_rank_accuracy(heads, data, args.ranks)
    sizes = [int(s) for s in args.sizes.split(",")]
    result: dict[str, object] = {
        "held_out_prompts": f"{args.first}..{args.first + args.prompts - 1}",
        "positions": data.positions,
        "rank_accuracy": accuracy,
        "built_in": {
            "nodes": len(DEFAULT_MEDUSA_TREE),
            "expected_tokens": round(tree_expected_tokens(accuracy, DEFAULT_MEDUSA_TREE), 4),
        },
    }
    for size in sizes:
        tree = sparse_tree(accuracy, size)
        result[f"sparse_{size}"] = {
            "expected_tokens": round(tree_expected_tokens(accuracy, tree), 4),
            "tree": [list(p) for p in tree],
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
