"""The demo target's shape with random weights, for a machine its weights cannot reach.

    python -m bench.demo_shape SOURCE OUT     # SOURCE: the demo target's files but its weights

A GPU machine lent to the project has no network and takes 64 MiB of files: the demo's 257 MB
of weights do not travel, its configuration and tokenizer do (``make gpu-wheels`` puts them in
``.whl/demo-shape``). A plain decode step's time does not depend on the weights' values, only
on their shapes and dtype, so ``bench.step_profile`` on this model measures what it would on
the demo's (acceptance rates, which do depend on the values, are not measured on it).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# Everything of a model directory but its weights.
SHAPE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja")  # fmt: skip


def copy_shape(source: Path, out: Path) -> None:
    """The files of ``source`` that say its shape and tokenizer, without its weights."""
    out.mkdir(parents=True, exist_ok=True)
    for name in SHAPE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)


def build(shape: Path, out: Path, seed: int = 0) -> Path:
    """A model of ``shape``'s configuration with seeded random weights, saved to ``out`` with
    the tokenizer files beside it."""
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(shape)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)  # its configuration (in bfloat16) and weights
    for name in SHAPE_FILES:
        if (shape / name).is_file() and not (out / name).is_file():
            shutil.copy2(shape / name, out / name)
    return out


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
