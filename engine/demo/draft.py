"""Distil the demo draft from the demo target, on the target's own answers.

The draft is the target's first ``layers`` decoder layers with its embeddings and final norm,
and an output head over the ``head_tokens`` tokens the target writes most often (ranked on
its answers to the distillation prompts). The tied 49,152-token head is a fifth of the
target's parameters, so a full-vocabulary draft would pay most of a target pass for its
head alone; the subset head keeps the draft's pass cost small. Proposals then come from the
subset only (the draft's q is 0 outside it), which rejection sampling handles exactly: the
subset limits what the draft can propose, never what the target can output.

Training: the target answers each prompt greedily, and the draft learns to predict those
answers (``distill``). A tenth of the answers is held out to measure greedy agreement.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from engine.demo.corpus import load_corpus
from engine.demo.prompts import Messages, distillation_prompts
from engine.proposers.vocabulary import VOCABULARY_FILE

Progress = Callable[[str, int, int, float], None]
# Longer prompts are cut from the left: prefill would take the budget the answers need.
MAX_PROMPT_TOKENS = 256


@dataclass(frozen=True)
class DraftSpec:
    layers: int = 2
    head_tokens: int = 8192
    prompts: int = 640
    answer_tokens: int = 160
    generation_batch: int = 64
    steps: int = 200
    batch_size: int = 16
    lr: float = 2e-3
    warmup_steps: int = 20
    held_out_share: float = 0.1
    seed: int = 1234


QUICK_DRAFT = DraftSpec(
    layers=1, head_tokens=256, prompts=8, answer_tokens=8, generation_batch=4, steps=2,
    batch_size=2,
)


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, chat: Messages, limit: int) -> list[int]:
    ids = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return [int(i) for i in cast(list[int], ids)][-limit:]


@torch.inference_mode()
def target_answers(
    target: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, chats: list[Messages],
    spec: DraftSpec, progress: Progress,
) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, greedy answer ids)`` for every chat, generated in left-padded batches."""
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    prompts = [_prompt_ids(tokenizer, chat, MAX_PROMPT_TOKENS) for chat in chats]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    pairs: dict[int, tuple[list[int], list[int]]] = {}
    for start in range(0, len(order), spec.generation_batch):
        batch = order[start : start + spec.generation_batch]
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        out = target.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=spec.answer_tokens,
            do_sample=False, pad_token_id=pad, eos_token_id=eos,
        )[:, width:]
        for row, i in enumerate(batch):
            answer = out[row].tolist()
            if eos in answer:
                answer = answer[: answer.index(eos) + 1]
            pairs[i] = (prompts[i], answer)
        progress("answers", start + len(batch), len(order), 0.0)
    return [pairs[i] for i in range(len(prompts))]


def frequency_ranked_vocabulary(
    answers: list[list[int]], size: int, always: set[int], vocab_size: int
) -> list[int]:
    """The ``size`` most frequent answer tokens (ties by id), plus ``always``, sorted by id."""
    counts = Counter(t for answer in answers for t in answer)
    ranked = [t for t, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]
    chosen = set(always)
    for token in ranked:
        if len(chosen) >= size:
            break
        chosen.add(token)
    # Too few distinct tokens in the answers: fill with the lowest ids (byte-level tokens).
    filler = iter(range(vocab_size))
    while len(chosen) < min(size, vocab_size):
        chosen.add(next(filler))
    return sorted(chosen)


def init_draft(target: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """The target's first ``layers`` layers, embeddings and norm, with an untied head copied
    from the target's (tied) output embedding; float32 for training."""
    values = target.config.to_dict()
    values.update(num_hidden_layers=layers, tie_word_embeddings=False)
    for key in ("dtype", "_name_or_path"):
        values.pop(key, None)
    draft = LlamaForCausalLM(LlamaConfig(**values))
    state = {
        name: tensor
        for name, tensor in target.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    state["lm_head.weight"] = target.lm_head.weight
    draft.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return draft


def _lr_at(spec: DraftSpec, step: int) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return spec.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def _batch(
    pairs: list[tuple[list[int], list[int]]], pad: int, index_of: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and labels: at each answer position the index in the
    head vocabulary of the target's next token (-100 where there is none or it is outside)."""
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (prompt, answer) in enumerate(pairs):
        sequence = torch.tensor(prompt + answer)
        ids[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1
        labels[row, len(prompt) - 1 : len(sequence) - 1] = index_of[torch.tensor(answer)]
    return ids, mask, labels


def distill(
    draft: LlamaForCausalLM, pairs: list[tuple[list[int], list[int]]], vocabulary: torch.Tensor,
    spec: DraftSpec, pad: int, progress: Progress,
) -> list[float]:
    """Sequence-level distillation: cross-entropy on the target's own greedy answers, which
    are exactly the tokens greedy speculation must propose (no teacher pass is needed, so the
    whole budget goes to the target's answers). The embeddings stay frozen (the draft shares
    the target's); the layers, the norm and the head's vocabulary rows learn. Returns the loss
    of every tenth step."""
    rng = random.Random(spec.seed)
    index_of = torch.full((draft.config.vocab_size,), -100, dtype=torch.long)
    index_of[vocabulary] = torch.arange(len(vocabulary))
    head = torch.nn.Parameter(draft.lm_head.weight.detach()[vocabulary].clone())
    draft.model.embed_tokens.weight.requires_grad_(False)
    trained = [*draft.model.layers.parameters(), *draft.model.norm.parameters(), head]
    optimizer = torch.optim.AdamW(trained, lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses: list[float] = []
    draft.train()
    for step in range(spec.steps):
        batch = rng.sample(pairs, min(spec.batch_size, len(pairs)))
        ids, mask, labels = _batch(batch, pad, index_of)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
            logits = F.linear(hidden[labels >= 0], head)
        loss = F.cross_entropy(logits.float(), labels[labels >= 0])
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
    draft: LlamaForCausalLM, target: LlamaForCausalLM, pairs: list[tuple[list[int], list[int]]],
    vocabulary: torch.Tensor | None,
) -> float:
    """Share of answer positions where the draft's most likely next token (over the subset
    when given) is the target's: greedy speculation's per-token acceptance on the target's
    own text."""
    agree = total = 0
    for prompt, answer in pairs:
        ids = torch.tensor([prompt + answer])
        start = len(prompt) - 1
        wanted = target(input_ids=ids).logits[0, start:-1].argmax(-1)
        logits = draft(input_ids=ids).logits[0, start:-1]
        if vocabulary is None:
            got = logits.argmax(-1)
        else:
            got = vocabulary[logits[:, vocabulary].argmax(-1)]
        agree += int((got == wanted).sum())
        total += len(answer)
    return agree / max(1, total)


def build_draft(
    target: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, out: Path, spec: DraftSpec,
    progress: Progress,
) -> dict[str, object]:
    """Build the draft into ``out`` (``out.partial`` until finished); returns its manifest."""
    started = time.perf_counter()
    seconds: dict[str, float] = {}
    torch.manual_seed(spec.seed)
    corpus = load_corpus()
    chats = distillation_prompts(corpus.train, spec.prompts, spec.seed)
    pairs = target_answers(target, tokenizer, chats, spec, progress)
    seconds["answers"] = round(time.perf_counter() - started, 1)
    held = max(1, int(len(pairs) * spec.held_out_share))
    train_pairs, held_pairs = pairs[held:], pairs[:held]
    always = {int(t) for t in tokenizer.all_special_ids}
    vocabulary = torch.tensor(
        frequency_ranked_vocabulary(
            [a for _, a in train_pairs], spec.head_tokens, always, target.config.vocab_size
        )
    )
    held_tokens = [t for _, a in held_pairs for t in a]
    coverage = sum(t in set(vocabulary.tolist()) for t in held_tokens) / max(1, len(held_tokens))
    draft = init_draft(target, spec.layers)
    agreement_before = greedy_agreement(draft, target, held_pairs, vocabulary)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    phase = time.perf_counter()
    losses = distill(draft, train_pairs, vocabulary, spec, pad, progress)
    seconds["distillation"] = round(time.perf_counter() - phase, 1)
    torch.nn.Module.to(draft, dtype=target.dtype)
    manifest: dict[str, object] = {
        "spec": asdict(spec),
        "initialised_from": f"target layers[:{spec.layers}], embeddings, norm, output head",
        "parameters": sum(p.numel() for p in draft.parameters()),
        "train_sequences": len(train_pairs),
        "train_answer_tokens": sum(len(a) for _, a in train_pairs),
        "held_out_answers": len(held_pairs),
        "head_vocabulary": len(vocabulary),
        "held_out_answer_tokens_in_head_vocabulary": round(coverage, 4),
        "greedy_agreement_before": round(agreement_before, 4),
        "greedy_agreement": round(greedy_agreement(draft, target, held_pairs, vocabulary), 4),
        "greedy_agreement_full_head": round(greedy_agreement(draft, target, held_pairs, None), 4),
        "cross_entropy_every_10_steps": losses,
    }
    staging = out.with_name(out.name + ".partial")
    draft.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / VOCABULARY_FILE).write_text(json.dumps(vocabulary.tolist()) + "\n")
    manifest["seconds"] = {**seconds, "total": round(time.perf_counter() - started, 1)}
    (staging / "specgate-draft.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.replace(out)
    return manifest
