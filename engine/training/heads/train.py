"""Self-distillation of draft heads (Medusa, EAGLE) on a frozen target.

The data (``engine.training.heads.data``) is the target's own greedy answers and continuations, with
its features at every position. Medusa head k learns, at every position t of the target's
own tokens, the target's distribution of the token at t + 2 + k (its LM head over the feature
at t + 1 + k: soft labels, whose top token is the one the target wrote). The EAGLE draft
learns, at every position (prompt included: it reads the prompt at inference too), the
target's next feature (smooth L1) and, through the target's LM head, the target's
distribution of the token after it (EAGLE's regression and classification losses). Both
score tokens over the draft vocabulary, the ``draft_vocab_size`` tokens the target wrote most
often in this data (``engine.training.heads.vocabulary``). The target is never updated, so its
features are computed once and the steps touch only the heads. Everything is seeded: the same
target, data and seed give the same heads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.training.heads.data import DataSpec, Distillation, Messages, distillation_data
from engine.training.heads.eagle import EagleConfig, EagleDraft
from engine.training.heads.medusa import MedusaConfig, MedusaHeads
from engine.training.heads.vocabulary import DraftHead, frequent_tokens

Progress = Callable[[str, int, int, float], None]


@dataclass(frozen=True)
class HeadsSpec:
    num_heads: int = 4
    num_layers: int = 1
    snippets: int = 256
    prompt_tokens: int = 64
    answer_tokens: int = 96
    generation_batch: int = 32
    steps: int = 300
    rows_per_step: int = 256
    lr: float = 1e-3
    warmup_steps: int = 0
    seed: int = 0
    # The tokens the heads score (None: the target's whole vocabulary).
    draft_vocab_size: int | None = None
    # EAGLE only: whole sequences per step (its layer attends along them), the weight of the
    # token loss beside the feature regression, and the uniform noise added to the input
    # features (EAGLE's: drafting deeper reads the draft's own, inexact, features).
    sequences_per_step: int = 4
    token_loss_weight: float = 0.1
    feature_noise: float = 0.1

    def data(self) -> DataSpec:
        return DataSpec(
            snippets=self.snippets, prompt_tokens=self.prompt_tokens,
            answer_tokens=self.answer_tokens, generation_batch=self.generation_batch,
            seed=self.seed,
        )


def corpus_texts(data: Path | None, limit_files: int = 400) -> list[str]:
    """Texts to continue: ``data``'s .txt/.py/.md files, else the demo corpus (the stdlib's
    training files, engine.training.demo.corpus), in sorted order."""
    if data is None:
        from engine.training.demo.corpus import load_corpus

        return [f.text for f in load_corpus(max_files=limit_files).train]
    files = sorted(p for p in data.rglob("*") if p.suffix in {".txt", ".py", ".md"})
    return [p.read_text(errors="replace") for p in files]


def demo_chats(count: int, seed: int) -> list[Messages]:
    """The demo's distillation prompts (everyday and code questions, completion, editing, JSON
    extraction; none of the benchmark's)."""
    from engine.training.demo.corpus import load_corpus
    from engine.training.demo.prompts import distillation_prompts

    return [prompt.messages for prompt in distillation_prompts(load_corpus().train, count, seed)]


def build_data(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str],
    spec: HeadsSpec, target_version: str, progress: Progress,
    chats: list[Messages] | None = None, cache_dir: Path | None = None,
    prompts: list[list[int]] | None = None,
) -> Distillation:
    """``distillation_data`` for ``spec``: the target's answers to ``chats`` and to the
    tokenized ``prompts``, and its continuations of snippets of ``texts``."""
    return distillation_data(
        target, tokenizer, target_version, spec.data(), progress, texts=texts,
        chats=chats or [], cache_dir=cache_dir, prompts=prompts or [],
    )


def _lr_at(spec: HeadsSpec, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    done = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return spec.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, done))))


def _draft_head(
    target: PreTrainedModel, data: Distillation, spec: HeadsSpec, eos: int | None
) -> tuple[DraftHead, torch.nn.Linear]:
    """The draft vocabulary's head over the target's (frozen) LM head, and that LM head."""
    lm_head = target.get_output_embeddings()
    assert isinstance(lm_head, torch.nn.Linear)
    lm_head.requires_grad_(False)
    vocab = int(lm_head.weight.shape[0])
    if spec.draft_vocab_size is None or spec.draft_vocab_size >= vocab:
        return DraftHead(lm_head), lm_head
    always = [eos] if eos is not None else []
    vocabulary = frequent_tokens(data.own_tokens, spec.draft_vocab_size, always, vocab)
    return DraftHead(lm_head, vocabulary), lm_head


def _soft_cross_entropy(logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` against the teacher's distribution (from its logits)."""
    target = torch.softmax(teacher.float(), dim=-1)
    return -(target * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


def _step(optimizer: torch.optim.Optimizer, spec: HeadsSpec, step: int) -> None:
    """One optimiser step at the scheduled rate, gradients clipped to norm 1 (the draft's
    layer diverged at 3e-3 without it)."""
    for group in optimizer.param_groups:
        group["lr"] = _lr_at(spec, step)
        torch.nn.utils.clip_grad_norm_(group["params"], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_medusa(
    target: PreTrainedModel, data: Distillation, spec: HeadsSpec, target_version: str,
    progress: Progress, eos: int | None = None,
) -> tuple[MedusaHeads, list[float]]:
    """Heads trained on ``data``; returns them and the loss of every tenth step."""
    torch.manual_seed(spec.seed)
    head, lm_head = _draft_head(target, data, spec, eos)
    config = MedusaConfig(
        medusa_num_heads=spec.num_heads, medusa_num_layers=spec.num_layers,
        hidden_size=data.hidden.shape[-1], vocab_size=int(lm_head.weight.shape[0]),
        target_model_version=target_version,
        draft_vocab_size=None if head.vocabulary is None else head.size,
    )
    heads = MedusaHeads(config, lm_head, vocabulary=head.vocabulary)
    rows = medusa_rows(data, spec.num_heads)
    if not rows:
        raise ValueError("the target's answers are too short for this many heads")
    optimizer = torch.optim.AdamW(heads.parameters(), lr=spec.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(spec.seed)
    losses: list[float] = []
    heads.train()
    for step in range(spec.steps):
        pick = torch.randint(len(rows), (min(spec.rows_per_step, len(rows)),), generator=generator)
        seq = torch.tensor([rows[i][0] for i in pick])
        pos = torch.tensor([rows[i][1] for i in pick])
        h = data.hidden[seq, pos]
        loss = torch.zeros(())
        for k in range(spec.num_heads):
            with torch.no_grad():
                teacher = heads.head(data.hidden[seq, pos + 1 + k])
            loss = loss + _soft_cross_entropy(heads.logits(h, k), teacher)
        loss = loss / spec.num_heads
        loss.backward()
        _step(optimizer, spec, step)
        if step % 10 == 0:
            losses.append(round(loss.item(), 4))
        progress("training", step + 1, spec.steps, loss.item())
    return heads.eval(), losses


def medusa_rows(data: Distillation, num_heads: int) -> list[tuple[int, int]]:
    """``(sequence, t)`` for the positions t from the last prompt token on whose token
    t + 2 + k exists for every head ``k < num_heads``."""
    return [
        (s, t)
        for s in range(data.ids.shape[0])
        for t in range(int(data.own_from[s]) - 1, int(data.lengths[s]) - 2 - num_heads + 1)
    ]


@torch.no_grad()
def medusa_accuracy(heads: MedusaHeads, data: Distillation) -> list[float]:
    """Per head k, the share of answer positions t (``medusa_rows``) where the head's most
    likely token is the one the target wrote at t + 2 + k: its top-1 acceptance under greedy
    speculation, measured on ``data`` (held-out answers, for a fair figure)."""
    return [ranks[0] for ranks in medusa_rank_accuracy(heads, data, 1)]


@torch.no_grad()
def medusa_rank_accuracy(heads: MedusaHeads, data: Distillation, ranks: int) -> list[list[float]]:
    """Per head k and rank r < ``ranks``, the share of answer positions (``medusa_rows``)
    where the head's r-th most likely token is the one the target wrote at t + 2 + k: what a
    static tree's node of that rank at that depth is accepted at (``sparse_tree``)."""
    k_heads = heads.config.medusa_num_heads
    rows = medusa_rows(data, k_heads)
    seq = torch.tensor([s for s, _ in rows])
    pos = torch.tensor([t for _, t in rows])
    table = []
    for k in range(k_heads):
        hits = torch.zeros(ranks)
        for s, p in zip(seq.split(1024), pos.split(1024), strict=True):
            top = heads.to_target(torch.topk(heads.logits(data.hidden[s, p], k), ranks).indices)
            hits += (top == data.ids[s, p + 2 + k].unsqueeze(-1)).sum(0)
        table.append([round(float(h) / max(1, len(rows)), 4) for h in hits])
    return table


def split_sequences(data: Distillation, held_out_share: float) -> tuple[Distillation, Distillation]:
    """``data`` cut into training and held-out sequences: every ``1 / held_out_share``-th
    sequence is held out (the prompts' kinds cycle, so each kind keeps its share)."""
    every = max(2, round(1 / held_out_share))
    index = torch.arange(data.ids.shape[0])
    held = index % every == every - 1

    def part(rows: torch.Tensor) -> Distillation:
        return Distillation(
            ids=data.ids[rows], lengths=data.lengths[rows], own_from=data.own_from[rows],
            hidden=data.hidden[rows],
        )

    return part(index[~held]), part(index[held])


def train_eagle(
    target: PreTrainedModel, data: Distillation, spec: HeadsSpec, target_version: str,
    target_name: str | None, progress: Progress, eos: int | None = None,
) -> tuple[EagleDraft, list[float]]:
    """An EAGLE draft trained on ``data``; returns it and the loss of every tenth step.

    Each step takes whole sequences: at position t the draft reads the target's feature f_t
    (plus noise) and the token x_{t+1}, and learns f_{t+1} (smooth L1) and the target's
    distribution of x_{t+2} (its LM head over f_{t+1}), at ``rows_per_step`` positions drawn
    from every real one (the LM head dominates a step's cost)."""
    torch.manual_seed(spec.seed)
    embed = target.get_input_embeddings()
    assert isinstance(embed, torch.nn.Module)
    embed.requires_grad_(False)
    head, lm_head = _draft_head(target, data, spec, eos)
    config = EagleConfig.for_target(
        target.config, int(lm_head.weight.shape[0]), target_name, target_version
    )
    if head.vocabulary is not None:
        config = dataclasses.replace(config, draft_vocab_size=head.size)
    draft = EagleDraft(config, embed, lm_head, head.vocabulary)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=spec.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(spec.seed)
    losses: list[float] = []
    draft.train()
    for step in range(spec.steps):
        pick = torch.randint(
            data.ids.shape[0], (min(spec.sequences_per_step, data.ids.shape[0]),),
            generator=generator,
        )
        length = int(data.lengths[pick].max())
        features = data.hidden[pick, : length - 1]
        following = data.hidden[pick, 1:length]
        noise = torch.rand(features.shape, generator=generator) * 2 - 1
        positions = torch.arange(length - 1)
        predicted, _, _ = draft(
            features + noise * spec.feature_noise, data.ids[pick, 1:length], positions
        )
        # Real positions t: both f_t and f_{t+1} inside the sequence.
        real = positions[None] < (data.lengths[pick, None] - 1)
        regression = F.smooth_l1_loss(predicted[real], following[real])
        rows = predicted[real]
        keep = torch.randperm(rows.shape[0], generator=generator)[: spec.rows_per_step]
        with torch.no_grad():
            teacher = head(following[real][keep])
        tokens = _soft_cross_entropy(draft.logits(rows[keep]), teacher)
        loss = regression + spec.token_loss_weight * tokens
        loss.backward()
        _step(optimizer, spec, step)
        if step % 10 == 0:
            losses.append(round(loss.item(), 4))
        progress("training", step + 1, spec.steps, loss.item())
    return draft.eval(), losses

