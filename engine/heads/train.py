"""Self-distillation of draft heads (Medusa, EAGLE) on a frozen target.

The target continues snippets of a corpus greedily (its own continuations, the tokens greedy
speculation must propose); one frozen pass over each sequence gives the hidden states. Medusa
head k then learns, at every continuation position t, the token the target wrote at
t + 2 + k; the EAGLE draft learns the target's next feature and, through the target's LM
head, the token after it (EAGLE's regression and classification losses). The target is never
updated, so the hidden states are computed once and the training steps touch only the heads
(and read the target's embedding and LM head). Everything is seeded: the same target, data
and seed give the same heads.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.heads.eagle import EagleConfig, EagleDraft
from engine.heads.medusa import MedusaConfig, MedusaHeads

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
    seed: int = 0
    # EAGLE only: whole sequences per step (its layer attends along them), the weight of the
    # token loss beside the feature regression, and the uniform noise added to the input
    # features (EAGLE's: drafting deeper reads the draft's own, inexact, features).
    sequences_per_step: int = 4
    token_loss_weight: float = 0.1
    feature_noise: float = 0.1


def corpus_texts(data: Path | None, limit_files: int = 400) -> list[str]:
    """Texts to continue: ``data``'s .txt/.py/.md files, else the demo corpus (the stdlib's
    training files, engine.demo.corpus), in sorted order."""
    if data is None:
        from engine.demo.corpus import load_corpus

        return [f.text for f in load_corpus(max_files=limit_files).train]
    files = sorted(p for p in data.rglob("*") if p.suffix in {".txt", ".py", ".md"})
    return [p.read_text(errors="replace") for p in files]


def snippets(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], spec: HeadsSpec
) -> list[list[int]]:
    """``spec.snippets`` prompts of ``spec.prompt_tokens`` tokens at seeded offsets."""
    rng = random.Random(spec.seed)
    encoded = [ids for ids in (tokenizer.encode(t) for t in texts) if len(ids) > spec.prompt_tokens]
    if not encoded:
        raise ValueError("no text long enough to cut prompts from")
    out = []
    for _ in range(spec.snippets):
        ids = rng.choice(encoded)
        start = rng.randrange(len(ids) - spec.prompt_tokens)
        out.append(ids[start : start + spec.prompt_tokens])
    return out


@torch.inference_mode()
def continuations(
    target: PreTrainedModel, prompts: list[list[int]], spec: HeadsSpec, pad: int,
    progress: Progress,
) -> list[list[int]]:
    """Prompt plus the target's greedy continuation, for each prompt (all the same length)."""
    out: list[list[int]] = []
    for start in range(0, len(prompts), spec.generation_batch):
        batch = torch.tensor(prompts[start : start + spec.generation_batch])
        generated = target.generate(  # type: ignore[operator]
            input_ids=batch, attention_mask=torch.ones_like(batch),
            max_new_tokens=spec.answer_tokens, min_new_tokens=spec.answer_tokens,
            do_sample=False, pad_token_id=pad,
        )
        out.extend(generated.tolist())
        progress("continuations", len(out), len(prompts), 0.0)
    return out


@torch.inference_mode()
def hidden_states(target: PreTrainedModel, sequences: list[list[int]]) -> torch.Tensor:
    """The input of the target's LM head at every position, ``[sequences, length, hidden]``."""
    captured: list[torch.Tensor] = []
    head = target.get_output_embeddings()
    assert head is not None
    hook = head.register_forward_pre_hook(lambda _m, inputs: captured.append(inputs[0].float()))
    try:
        # Small batches: the LM head runs on every position (its input is what we keep).
        for start in range(0, len(sequences), 4):
            target(input_ids=torch.tensor(sequences[start : start + 4]))
    finally:
        hook.remove()
    return torch.cat(captured)


def _distillation_data(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str],
    spec: HeadsSpec, progress: Progress,
) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Linear]:
    """The target's continuations ``[sequences, length]``, its hidden states there
    ``[sequences, length, hidden]`` and its (frozen) LM head."""
    torch.manual_seed(spec.seed)
    target.eval()
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    sequences = continuations(target, snippets(tokenizer, texts, spec), spec, pad, progress)
    hidden = hidden_states(target, sequences)
    lm_head = target.get_output_embeddings()
    assert isinstance(lm_head, torch.nn.Linear)
    lm_head.requires_grad_(False)
    return torch.tensor(sequences), hidden, lm_head


def train_medusa(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str],
    spec: HeadsSpec, target_version: str, progress: Progress,
) -> tuple[MedusaHeads, list[float]]:
    """Heads trained on ``target``'s continuations of ``texts``; returns them and the loss
    of every tenth step."""
    ids, hidden, lm_head = _distillation_data(target, tokenizer, texts, spec, progress)
    config = MedusaConfig(
        medusa_num_heads=spec.num_heads, medusa_num_layers=spec.num_layers,
        hidden_size=hidden.shape[-1], vocab_size=int(lm_head.weight.shape[0]),
        target_model_version=target_version,
    )
    heads = MedusaHeads(config, lm_head)
    # Positions t in the continuation whose token t + 2 + k exists for every head.
    first = spec.prompt_tokens - 1
    last = ids.shape[1] - 2 - spec.num_heads
    rows = [(s, t) for s in range(ids.shape[0]) for t in range(first, last + 1)]
    optimizer = torch.optim.AdamW(heads.parameters(), lr=spec.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(spec.seed)
    losses: list[float] = []
    heads.train()
    for step in range(spec.steps):
        pick = torch.randint(len(rows), (min(spec.rows_per_step, len(rows)),), generator=generator)
        seq = torch.tensor([rows[i][0] for i in pick])
        pos = torch.tensor([rows[i][1] for i in pick])
        h = hidden[seq, pos]
        loss = torch.zeros(())
        for k in range(spec.num_heads):
            loss = loss + F.cross_entropy(heads.logits(h, k).float(), ids[seq, pos + 2 + k])
        loss = loss / spec.num_heads
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0:
            losses.append(round(loss.item(), 4))
        progress("training", step + 1, spec.steps, loss.item())
    return heads.eval(), losses


def train_eagle(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str],
    spec: HeadsSpec, target_version: str, target_name: str | None, progress: Progress,
) -> tuple[EagleDraft, list[float]]:
    """An EAGLE draft trained on ``target``'s continuations of ``texts``; returns it and the
    loss of every tenth step.

    Each step takes whole sequences: at position t the draft reads the target's feature f_t
    (plus noise) and the token x_{t+1}, and learns f_{t+1} (smooth L1) and, through the
    target's LM head, x_{t+2} where the target wrote it itself (the continuation), at
    ``rows_per_step`` positions drawn from those."""
    ids, hidden, lm_head = _distillation_data(target, tokenizer, texts, spec, progress)
    embed = target.get_input_embeddings()
    assert isinstance(embed, torch.nn.Module)
    embed.requires_grad_(False)
    config = EagleConfig.for_target(
        target.config, int(lm_head.weight.shape[0]), target_name, target_version
    )
    draft = EagleDraft(config, embed, lm_head)
    length = ids.shape[1]
    positions = torch.arange(length - 1)
    # Outputs at t predict x_{t+2}; the target's own tokens start at prompt_tokens.
    first = max(0, spec.prompt_tokens - 2)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=spec.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(spec.seed)
    losses: list[float] = []
    draft.train()
    for step in range(spec.steps):
        pick = torch.randint(
            ids.shape[0], (min(spec.sequences_per_step, ids.shape[0]),), generator=generator
        )
        features = hidden[pick, :-1]
        noise = torch.rand(features.shape, generator=generator) * 2 - 1
        predicted, _, _ = draft(features + noise * spec.feature_noise, ids[pick, 1:], positions)
        regression = F.smooth_l1_loss(predicted, hidden[pick, 1:])
        # The LM head dominates a step's cost: the token loss takes rows_per_step of them.
        rows = predicted[:, first : length - 2].flatten(0, 1)
        labels = ids[pick, first + 2 :].flatten()
        keep = torch.randperm(rows.shape[0], generator=generator)[: spec.rows_per_step]
        tokens = F.cross_entropy(draft.logits(rows[keep]).float(), labels[keep])
        loss = regression + spec.token_loss_weight * tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0:
            losses.append(round(loss.item(), 4))
        progress("training", step + 1, spec.steps, loss.item())
    return draft.eval(), losses
