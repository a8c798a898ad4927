"""Self-distillation of Medusa heads on a frozen target.

The target continues snippets of a corpus greedily (its own continuations, the tokens greedy
speculation must propose); one frozen pass over each sequence gives the hidden states; head
k then learns, at every continuation position t, the token the target wrote at t + 2 + k.
The target is never updated, so the hidden states are computed once and the training steps
touch only the heads (and read the target's LM head). Everything is seeded: the same target,
data and seed give the same heads.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

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


def train_medusa(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str],
    spec: HeadsSpec, target_version: str, progress: Progress,
) -> tuple[MedusaHeads, list[float]]:
    """Heads trained on ``target``'s continuations of ``texts``; returns them and the loss
    of every tenth step."""
    torch.manual_seed(spec.seed)
    target.eval()
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    sequences = continuations(target, snippets(tokenizer, texts, spec), spec, pad, progress)
    hidden = hidden_states(target, sequences)
    ids = torch.tensor(sequences)
    lm_head = target.get_output_embeddings()
    assert isinstance(lm_head, torch.nn.Linear)
    lm_head.requires_grad_(False)
    config = MedusaConfig(
        medusa_num_heads=spec.num_heads, medusa_num_layers=spec.num_layers,
        hidden_size=hidden.shape[-1], vocab_size=int(lm_head.weight.shape[0]),
        target_model_version=target_version,
    )
    heads = MedusaHeads(config, lm_head)
    # Positions t in the continuation whose token t + 2 + k exists for every head.
    first = spec.prompt_tokens - 1
    last = ids.shape[1] - 2 - spec.num_heads
    rows = [(s, t) for s in range(len(sequences)) for t in range(first, last + 1)]
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
