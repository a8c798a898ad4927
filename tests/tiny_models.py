"""Tiny Llama models built from configs for the tests: real checkpoints on disk, random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from engine.models.loading import load_model
from engine.models.packed_linear import pack_linear_weights
from engine.training.demo.tokenizer import train_tokenizer

SAMPLE_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "The quick brown fox jumps over the lazy dog. Hello, world!\n",
] * 20


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    return train_tokenizer(SAMPLE_TEXT, vocab_size=vocab_size)


def build_model(
    out: Path,
    tokenizer: PreTrainedTokenizerFast,
    *,
    seed: int,
    hidden: int = 64,
    layers: int = 2,
    vocab_size: int | None = None,
    max_positions: int = 512,
) -> Path:
    """Save a random Llama model (float32) with ``tokenizer`` beside it in ``out``."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    # Scale the output head so the random model has peaked, varied distributions.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_pair(root: Path, *, draft_seed: int = 1) -> tuple[Path, Path]:
    """A target and a draft sharing one tokenizer. The draft is a different random model."""
    tokenizer = build_tokenizer()
    target = build_model(root / "target", tokenizer, seed=0, hidden=64, layers=2)
    draft = build_model(root / "draft", tokenizer, seed=draft_seed, hidden=32, layers=1)
    return target, draft


def build_noisy_copy(source: Path, out: Path, *, noise: float, seed: int = 7) -> Path:
    """A draft that mostly agrees with ``source``: its weights plus Gaussian noise.

    ``noise`` is relative to each tensor's standard deviation; 0 gives an exact copy, whose
    proposals the target always accepts.
    """
    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(source)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * param.std() * noise)
    model.save_pretrained(out)
    PreTrainedTokenizerFast.from_pretrained(source).save_pretrained(out)
    return out


def build_three_layer_target(factory: pytest.TempPathFactory, name: str, seed: int) -> Path:
    """A three-layer tiny target in a fresh directory: the fixture of the CPU pass tests."""
    return build_model(factory.mktemp(name) / "target", build_tokenizer(), seed=seed, layers=3)


def load_packed(target: Path, dtype: str) -> PreTrainedModel:
    """``target`` loaded on the CPU as the engine serves it: linear weights packed (and Llama
    projections fused)."""
    model = load_model(target, torch.device("cpu"), dtype)  # type: ignore[arg-type]
    pack_linear_weights(model)
    return model
