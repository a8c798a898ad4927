"""Training loops for the demo pair: a target language model, then a draft distilled from it.

Weights stay float32. On CPUs that compute bfloat16 natively (AVX512-BF16, AMX) forward
passes run under bfloat16 autocast, which doubles the training throughput; elsewhere bfloat16
is emulated and over ten times slower than float32 (measured on a 2-core AVX2 EPYC: 35 s
against 2.9 s for one target step), so training stays float32. The draft is distilled from
the target in the precision the engine serves it in, with a KL loss on the target's full
next-token distribution, which raises how often its greedy proposals equal the target's far
beyond what training on the corpus alone gives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

StepCallback = Callable[[int, float], None]
# Code Llama's RoPE base. The induction head (``induction.py``) matches tokens on RoPE's
# slowest frequency pairs, which at this base turn by about a radian or less over the
# 1024 positions; at Llama's 10000 too few pairs are that slow.
ROPE_THETA = 1e6


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int


@dataclass(frozen=True)
class Schedule:
    """AdamW with linear warm-up and cosine decay to ``min_lr_ratio`` of the peak."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)


def llama_config(
    shape: ModelShape, tokenizer: PreTrainedTokenizerFast, max_positions: int
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
    )


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class TokenStream:
    """All documents' token ids end to end (EOS between documents); windows are cut at random."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def random_windows(self, generator: torch.Generator, count: int, length: int) -> torch.Tensor:
        starts = torch.randint(0, len(self.tokens) - length, (count,), generator=generator)
        return torch.stack([self.tokens[s : s + length] for s in starts.tolist()])

    def evenly_spaced_windows(self, count: int, length: int) -> torch.Tensor:
        """Fixed evaluation windows spread over the whole stream."""
        stride = max(1, (len(self.tokens) - length) // count)
        return torch.stack([self.tokens[i * stride : i * stride + length] for i in range(count)])


def _optimizer(model: torch.nn.Module, schedule: Schedule) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": schedule.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=schedule.lr, betas=(0.9, 0.95), eps=1e-8)


def _step(
    model: torch.nn.Module, optimizer: torch.optim.AdamW, schedule: Schedule, step: int,
    loss: torch.Tensor,
) -> None:
    for group in optimizer.param_groups:
        group["lr"] = schedule.lr_at(step)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_language_model(
    model: LlamaForCausalLM, stream: TokenStream, schedule: Schedule, seed: int,
    on_step: StepCallback, bfloat16: bool,
) -> None:
    """Next-token cross-entropy on random windows of the corpus."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = _optimizer(model, schedule)
    model.train()
    for step in range(schedule.steps):
        windows = stream.random_windows(generator, schedule.batch_size, schedule.seq_len + 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bfloat16):
            logits = model(input_ids=windows[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())
        _step(model, optimizer, schedule, step, loss)
        on_step(step, loss.item())


def init_draft_from_target(draft: LlamaForCausalLM, target: LlamaForCausalLM) -> None:
    """Start the draft as the target's first layer(s) plus its embeddings, norm and head.

    The shapes must agree except in depth. The draft then begins as an early exit of the
    target, which distillation turns into a good imitation far faster than from random.
    """
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.lm_head.load_state_dict(target.lm_head.state_dict())
    for index, layer in enumerate(draft.model.layers):
        layer.load_state_dict(target.model.layers[index].state_dict())


def distill_draft(
    draft: LlamaForCausalLM, teacher: LlamaForCausalLM, stream: TokenStream, schedule: Schedule,
    seed: int, on_step: StepCallback, bfloat16: bool,
) -> None:
    """KL(teacher || draft) over every position of random corpus windows."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = _optimizer(draft, schedule)
    draft.train()
    teacher.eval()
    for step in range(schedule.steps):
        windows = stream.random_windows(generator, schedule.batch_size, schedule.seq_len)
        with torch.inference_mode():
            teacher_logprobs = F.log_softmax(teacher(input_ids=windows).logits.float(), dim=-1)
        teacher_logprobs = teacher_logprobs.clone()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bfloat16):
            logits = draft(input_ids=windows).logits
        draft_logprobs = F.log_softmax(logits.float(), dim=-1)
        loss = F.kl_div(
            draft_logprobs.flatten(0, 1), teacher_logprobs.flatten(0, 1),
            log_target=True, reduction="batchmean",
        )
        _step(draft, optimizer, schedule, step, loss)
        on_step(step, loss.item())


@torch.inference_mode()
def held_out_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) on fixed held-out windows."""
    model.eval()
    losses = [
        F.cross_entropy(model(input_ids=w[None, :-1]).logits.float()[0], w[1:]).item()
        for w in windows
    ]
    return sum(losses) / len(losses)


@torch.inference_mode()
def greedy_agreement(
    draft: LlamaForCausalLM, target: LlamaForCausalLM, windows: torch.Tensor
) -> float:
    """Share of held-out positions where both models' most likely next token is the same.

    This is the per-token acceptance probability of greedy speculative decoding when the
    text so far is the target's own; a quick estimate of the acceptance rate to expect.
    """
    draft.eval()
    target.eval()
    agree = total = 0
    for w in windows:
        d = draft(input_ids=w[None]).logits.argmax(-1)
        t = target(input_ids=w[None]).logits.argmax(-1)
        agree += int((d == t).sum())
        total += d.numel()
    return agree / total
