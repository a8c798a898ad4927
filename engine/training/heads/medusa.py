"""Medusa heads: K small residual stacks over the target's last hidden state.

Head k, applied to the hidden state at position t (the input of the target's LM head there),
predicts the token at t + 2 + k: the target's own head already gives t + 1. Each head is
``medusa_num_layers`` residual blocks ``x + SiLU(W x + b)`` followed by an output layer; a
checkpoint trained by Specgate shares the target's (frozen) LM head instead of storing its
own, so the heads cost a few hidden-by-hidden matrices, not a vocabulary-sized head each,
and all heads run through that one head in a single matrix product. With a draft vocabulary
(``engine.training.heads.vocabulary``) they share only its rows for the tokens the target writes
most, which makes a draft step several times cheaper.

On disk (Medusa's layout, so heads trained elsewhere load): ``config.json`` with
``medusa_num_heads`` and ``medusa_num_layers`` (plus ``hidden_size``, ``vocab_size`` and the
``target_model_version`` they were trained on, and ``draft_vocab_size`` with a draft
vocabulary), weights in ``model.safetensors`` named ``medusa_head.{k}.{j}.linear.weight|bias``
and, where a head has its own output layer, ``medusa_head.{k}.{L}.weight``; a draft
vocabulary adds ``d2t`` and ``t2d``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from engine.training.heads import HeadsMismatchError
from engine.training.heads.checkpoint import CONFIG_FILE, WEIGHTS_FILE, Target, read_checkpoint
from engine.training.heads.vocabulary import DraftHead, extra_bytes


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        # Zero: an untrained block is the identity, so a head starts as the target's own head.
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.silu(self.linear(x))


@dataclass(frozen=True)
class MedusaConfig:
    medusa_num_heads: int
    medusa_num_layers: int
    hidden_size: int
    vocab_size: int
    target_model_version: str | None = None
    draft_vocab_size: int | None = None  # None: the target's whole head

    def as_dict(self) -> dict[str, object]:
        values: dict[str, object] = {
            "architectures": ["MedusaModel"],
            "medusa_num_heads": self.medusa_num_heads,
            "medusa_num_layers": self.medusa_num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "target_model_version": self.target_model_version,
        }
        if self.draft_vocab_size is not None:
            values["draft_vocab_size"] = self.draft_vocab_size
        return values


class MedusaHeads(nn.Module):
    def __init__(
        self,
        config: MedusaConfig,
        lm_head: nn.Module,
        own_heads: bool = False,
        vocabulary: torch.Tensor | None = None,
    ) -> None:
        """``vocabulary``: the draft vocabulary's target ids (None: the whole head)."""
        super().__init__()
        if own_heads and vocabulary is not None:
            raise ValueError("heads with their own output layers have no draft vocabulary")
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(config.hidden_size) for _ in range(config.medusa_num_layers)))
            for _ in range(config.medusa_num_heads)
        )
        self.own = (
            nn.ModuleList(
                nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                for _ in range(config.medusa_num_heads)
            )
            if own_heads
            else None
        )
        # The target's LM head (or its draft vocabulary's rows), not a parameter of the heads.
        self.head = DraftHead(lm_head, vocabulary)

    def features(self, hidden: torch.Tensor, head: int) -> torch.Tensor:
        result: torch.Tensor = self.blocks[head](hidden)
        return result

    def logits(self, hidden: torch.Tensor, head: int) -> torch.Tensor:
        """Head ``head``'s logits ``[..., draft vocabulary]`` from target hidden states
        ``[..., hidden]``."""
        if self.own is not None:
            own: torch.Tensor = self.own[head](self.features(hidden, head))
            return own
        result: torch.Tensor = self.head(self.features(hidden, head))
        return result

    def all_logits(self, hidden: torch.Tensor, heads: int) -> torch.Tensor:
        """The first ``heads`` heads' logits ``[heads, draft vocabulary]`` from one hidden
        state ``[hidden]``: the shared output head reads its weights once for all of them."""
        if self.own is not None:
            return torch.stack([self.logits(hidden, k) for k in range(heads)])
        stacked = torch.stack([self.features(hidden, k) for k in range(heads)])
        result: torch.Tensor = self.head(stacked)
        return result

    def to_target(self, indices: torch.Tensor) -> torch.Tensor:
        """Target token ids of the heads' output indices."""
        return self.head.to_target(indices)

    def extra_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def extra_bytes(self) -> int:
        """Memory the heads add to the target's (a draft vocabulary's rows included)."""
        return extra_bytes(self)

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        layers = self.config.medusa_num_layers
        tensors = {_to_medusa_name(name, layers): t for name, t in self.state_dict().items()}
        tensors.update(self.head.tensors(self.config.vocab_size))
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out / WEIGHTS_FILE))
        (out / CONFIG_FILE).write_text(json.dumps(self.config.as_dict(), indent=2) + "\n")


def read_config(heads_dir: Path) -> MedusaConfig:
    raw = json.loads((heads_dir / CONFIG_FILE).read_text())
    if "medusa_num_heads" not in raw:
        raise HeadsMismatchError(f"{heads_dir} holds no Medusa heads (no medusa_num_heads)")
    return MedusaConfig(
        medusa_num_heads=int(raw["medusa_num_heads"]),
        medusa_num_layers=int(raw.get("medusa_num_layers", 1)),
        hidden_size=int(raw["hidden_size"]),
        vocab_size=int(raw["vocab_size"]),
        target_model_version=raw.get("target_model_version"),
        draft_vocab_size=raw.get("draft_vocab_size"),
    )


def load_heads(
    heads_dir: Path, lm_head: nn.Module, hidden_size: int, vocab_size: int, target_version: str
) -> MedusaHeads:
    """Load heads for this target; heads trained on another version of it are refused,
    naming both versions (their predictions would be for a model that is not running)."""
    config = read_config(heads_dir)
    target = Target(target_version, hidden_size, vocab_size)
    checkpoint = read_checkpoint("medusa", heads_dir, config, target)
    tensors = checkpoint.weights
    own = f"medusa_head.0.{config.medusa_num_layers}.weight" in tensors
    heads = MedusaHeads(config, lm_head, own_heads=own, vocabulary=checkpoint.vocabulary)
    layers = config.medusa_num_layers
    state = {_to_medusa_name(name, layers): name for name in heads.state_dict()}
    missing = sorted(set(state) - set(tensors))
    if missing:
        raise HeadsMismatchError(f"heads in {heads_dir} lack {', '.join(missing[:3])}")
    heads.load_state_dict({name: tensors[key] for key, name in state.items()})
    return heads.eval()


def _to_medusa_name(name: str, layers: int) -> str:
    """Our parameter name in Medusa's checkpoint layout: ``blocks.k.j.linear.weight`` is
    ``medusa_head.k.j.linear.weight``, ``own.k.weight`` is ``medusa_head.k.<layers>.weight``."""
    kind, head, rest = name.split(".", 2)
    if kind == "own":
        return f"medusa_head.{head}.{layers}.{rest}"
    return f"medusa_head.{head}.{rest}"
