"""Distil the demo draft from the demo target, on the target's own answers.

The draft is a few of the target's decoder layers (``layers``, by index; the first two by
default) with its embeddings and final norm, and an output head over the ``head_tokens``
tokens the target writes most often (ranked on its answers to the distillation prompts). The
tied 49,152-token head is a fifth of the target's parameters, so a full-vocabulary draft
would pay most of a target pass for its head alone; the subset head keeps the draft's pass
cost small. Proposals then come from the subset only (the draft's q is 0 outside it), which
rejection sampling handles exactly: the subset limits what the draft can propose, never what
the target can output.

Training: the target answers each prompt greedily, and while it does, the build keeps its
``teacher_top_k`` most likely next tokens and their log-probabilities at every answer
position (``engine.training.demo.answers``: free, the logits are computed anyway; cached, so that
another training recipe on the same answers costs only its training). The draft learns the
target's distribution there, restricted to the head vocabulary (``soft_targets``,
``distill``); with ``teacher_top_k`` 1 that is cross-entropy on the greedy answer alone. A
tenth of the answers is held out to measure greedy agreement.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from engine.speculation.proposers.vocabulary import VOCABULARY_FILE
from engine.training.demo.answers import AnswerSpec, Progress, Prompt, Sample, cached_answers
from engine.training.demo.corpus import load_corpus
from engine.training.demo.prompts import distillation_prompts
from engine.training.heads.vocabulary import frequent_tokens


@dataclass(frozen=True)
class DraftSpec:
    layers: tuple[int, ...] = (0, 1)  # the target's layers the draft starts from, in order
    head_tokens: int = 8192
    prompts: int = 640
    answer_tokens: int = 160
    generation_batch: int = 64
    teacher_top_k: int = 32
    steps: int = 600
    batch_size: int = 16
    lr: float = 2e-3
    warmup_steps: int = 20
    held_out_share: float = 0.1
    seed: int = 1234

    @property
    def answers(self) -> AnswerSpec:
        """The part of the recipe that decides the target's answers (and their cache)."""
        return AnswerSpec(
            self.prompts, self.answer_tokens, self.generation_batch, self.teacher_top_k,
            self.seed,
        )


QUICK_DRAFT = DraftSpec(
    layers=(0,), head_tokens=256, prompts=8, answer_tokens=8, generation_batch=4,
    teacher_top_k=4, steps=2, batch_size=2,
)


def init_draft(target: LlamaForCausalLM, layers: tuple[int, ...]) -> LlamaForCausalLM:
    """The target's decoder layers ``layers`` (renumbered 0, 1, ...), embeddings and norm,
    with an untied head copied from the target's (tied) output embedding; float32."""
    values = target.config.to_dict()
    values.update(num_hidden_layers=len(layers), tie_word_embeddings=False)
    for key in ("dtype", "_name_or_path"):
        values.pop(key, None)
    draft = LlamaForCausalLM(LlamaConfig(**values))
    source = target.state_dict()
    state = {name: t for name, t in source.items() if not name.startswith("model.layers.")}
    for new, old in enumerate(layers):
        prefix = f"model.layers.{old}."
        state.update(
            {f"model.layers.{new}.{name[len(prefix):]}": t
             for name, t in source.items() if name.startswith(prefix)}
        )
    state["lm_head.weight"] = target.lm_head.weight
    draft.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return draft


def _lr_at(spec: DraftSpec, step: int) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return spec.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def soft_targets(
    top_ids: torch.Tensor, top_logprobs: torch.Tensor, index_of: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution restricted to the head vocabulary: for each position the
    head indices of its top-k tokens (0 where a token is outside the head) and their
    probabilities renormalised over the tokens inside (all 0 where none is inside)."""
    index = index_of[top_ids]
    inside = index >= 0
    probs = top_logprobs.exp() * inside
    total = probs.sum(-1, keepdim=True)
    probs = torch.where(total > 0, probs / total.clamp_min(1e-30), probs)
    return index.clamp_min(0), probs


def _batch(
    samples: list[Sample], pad: int, index_of: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask, the answer positions (where the next token is the
    target's), and at those positions, in order, the soft targets (``soft_targets``)."""
    width = max(len(s.prompt) + len(s.answer) for s in samples)
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    positions = torch.zeros_like(ids, dtype=torch.bool)
    for row, sample in enumerate(samples):
        sequence = torch.tensor(sample.prompt + sample.answer)
        ids[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1
        positions[row, len(sample.prompt) - 1 : len(sequence) - 1] = True
    index, probs = soft_targets(
        torch.cat([s.top_ids for s in samples]), torch.cat([s.top_logprobs for s in samples]),
        index_of,
    )
    return ids, mask, positions, index, probs


def head_index(vocabulary: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Maps a token id to its row in the head (-1 for tokens outside the head vocabulary)."""
    index_of = torch.full((vocab_size,), -1, dtype=torch.long)
    index_of[vocabulary] = torch.arange(len(vocabulary))
    return index_of


def distill(
    draft: LlamaForCausalLM, samples: list[Sample], vocabulary: torch.Tensor, spec: DraftSpec,
    pad: int, progress: Progress,
) -> list[float]:
    """Distillation on the target's own answers: at every answer position, cross-entropy from
    the target's top-k distribution (restricted to the head vocabulary) to the draft's (the
    KL divergence up to the target's entropy). The answers are exactly the contexts greedy
    speculation drafts in, and the distribution says how close the runners-up are. The
    embeddings stay frozen (the draft shares the target's); the layers, the norm and the
    head's vocabulary rows learn. Returns the loss of every tenth step."""
    rng = random.Random(spec.seed)
    index_of = head_index(vocabulary, draft.config.vocab_size)
    head = torch.nn.Parameter(draft.lm_head.weight.detach()[vocabulary].clone())
    draft.model.embed_tokens.weight.requires_grad_(False)
    trained = [*draft.model.layers.parameters(), *draft.model.norm.parameters(), head]
    optimizer = torch.optim.AdamW(trained, lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses: list[float] = []
    draft.train()
    for step in range(spec.steps):
        batch = rng.sample(samples, min(spec.batch_size, len(samples)))
        ids, mask, positions, index, probs = _batch(batch, pad, index_of)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
            logits = F.linear(hidden[positions], head)
        logprobs = logits.float().log_softmax(-1).gather(-1, index)
        counted = probs.sum(-1) > 0
        loss = -(probs * logprobs).sum(-1)[counted].mean()
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(spec, step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0:
            losses.append(round(loss.item(), 4))
        progress("distillation", step + 1, spec.steps, loss.item())
    with torch.no_grad():
        draft.lm_head.weight[vocabulary] = head.detach()
    draft.eval()
    return losses


@torch.inference_mode()
def greedy_agreement(
    draft: LlamaForCausalLM, samples: list[Sample], vocabulary: torch.Tensor | None
) -> dict[str, float]:
    """Share of answer positions where the draft's most likely next token (over the subset
    when given) is the target's greedy one, over all samples (``"all"``) and per kind:
    greedy speculation's per-token acceptance on the target's own text."""
    agree: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for sample in samples:
        ids = torch.tensor([sample.prompt + sample.answer])
        logits = draft(input_ids=ids).logits[0, len(sample.prompt) - 1 : -1]
        if vocabulary is None:
            got = logits.argmax(-1)
        else:
            got = vocabulary[logits[:, vocabulary].argmax(-1)]
        hits = int((got == torch.tensor(sample.answer)).sum())
        for key in ("all", sample.kind):
            agree[key] += hits
            total[key] += len(sample.answer)
    return {key: round(agree[key] / max(1, total[key]), 4) for key in sorted(total)}


@dataclass
class DistilledDraft:
    """A distilled draft, its head vocabulary, its manifest (the recipe, the target version
    and the figures: the same for the same answers and recipe), whether the answers were read
    back from the cache, and the seconds of each phase."""

    draft: LlamaForCausalLM
    vocabulary: torch.Tensor
    manifest: dict[str, object]
    answers_cached: bool
    seconds: dict[str, float]


def distil_draft(
    target: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, prompts: list[Prompt],
    spec: DraftSpec, progress: Progress, target_version: str, cache_dir: Path | None = None,
) -> DistilledDraft:
    """A draft distilled on the target's answers to ``prompts``, the first
    ``spec.held_out_share`` of them (at least one) held out to measure greedy agreement. With
    ``cache_dir``, the answers are read from there when cached for ``target_version`` and
    ``spec.answers``, and written there otherwise."""
    started = time.perf_counter()
    torch.manual_seed(spec.seed)
    samples, reused = cached_answers(
        target, tokenizer, prompts, spec.answers, progress, target_version, cache_dir
    )
    answers_seconds = round(time.perf_counter() - started, 1)
    held = max(1, int(len(samples) * spec.held_out_share))
    if len(samples) <= held:
        raise ValueError(f"{len(samples)} answer(s): a draft needs more than {held} to learn from")
    train, held_out = samples[held:], samples[:held]
    draft, vocabulary, report = train_draft(target, tokenizer, train, held_out, spec, progress)
    seconds = {"answers": answers_seconds, "distillation": cast(float, report.pop("seconds"))}
    manifest: dict[str, object] = {
        "spec": asdict(spec), "target_version": target_version, **report,
    }
    return DistilledDraft(draft, vocabulary, manifest, reused, seconds)


def build_draft(
    target: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, out: Path, spec: DraftSpec,
    progress: Progress, target_version: str, cache_dir: Path | None = None,
) -> dict[str, object]:
    """Build the demo draft, distilled on the demo corpus's prompts, into ``out``
    (``out.partial`` until finished); returns its manifest. ``cache_dir``: ``distil_draft``'s."""
    started = time.perf_counter()
    chats: list[Prompt] = list(
        distillation_prompts(load_corpus().train, spec.prompts, spec.seed)
    )
    built = distil_draft(target, tokenizer, chats, spec, progress, target_version, cache_dir)
    manifest: dict[str, object] = {
        **built.manifest, "answers_cached": built.answers_cached,
        "seconds": {**built.seconds, "total": round(time.perf_counter() - started, 1)},
    }
    save_draft(built.draft, tokenizer, built.vocabulary, manifest, out)
    return manifest


def save_draft(
    draft: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, vocabulary: torch.Tensor,
    manifest: dict[str, object], out: Path,
) -> None:
    """Write the draft, its tokenizer, head vocabulary and manifest into ``out`` atomically
    (``out.partial`` until finished)."""
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    draft.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / VOCABULARY_FILE).write_text(json.dumps(vocabulary.tolist()) + "\n")
    (staging / "specgate-draft.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.replace(out)


def train_draft(
    target: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, train: list[Sample],
    held_out: list[Sample], spec: DraftSpec, progress: Progress,
) -> tuple[LlamaForCausalLM, torch.Tensor, dict[str, object]]:
    """The draft (in the target's dtype), its head vocabulary, and the manifest's figures."""
    always = {int(t) for t in tokenizer.all_special_ids}
    vocabulary = frequent_tokens(
        [s.answer for s in train], spec.head_tokens, always, target.config.vocab_size
    )
    kept = set(vocabulary.tolist())
    held_tokens = [t for s in held_out for t in s.answer]
    coverage = sum(t in kept for t in held_tokens) / max(1, len(held_tokens))
    draft = init_draft(target, spec.layers)
    agreement_before = greedy_agreement(draft, held_out, vocabulary)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    phase = time.perf_counter()
    losses = distill(draft, train, vocabulary, spec, pad, progress)
    seconds = round(time.perf_counter() - phase, 1)
    agreement = greedy_agreement(draft, held_out, vocabulary)
    report: dict[str, object] = {
        "initialised_from": f"target layers {list(spec.layers)}, embeddings, norm, output head",
        "parameters": sum(p.numel() for p in draft.parameters()),
        "train_sequences": len(train),
        "train_answer_tokens": sum(len(s.answer) for s in train),
        "held_out_answers": len(held_out),
        "head_vocabulary": len(vocabulary),
        "held_out_answer_tokens_in_head_vocabulary": round(coverage, 4),
        "greedy_agreement_before": agreement_before["all"],
        "greedy_agreement": agreement["all"],
        "greedy_agreement_by_kind": agreement,
        "greedy_agreement_full_head": greedy_agreement(draft, held_out, None)["all"],
        "loss_every_10_steps": losses,
        "seconds": seconds,
    }
    torch.nn.Module.to(draft, dtype=target.dtype)
    return draft, vocabulary, report
