"""The target's greedy answers to the distillation prompts (chats, or prompts already
tokenized: a deployment's recorded requests), with its top-k distribution at every answer
position, and their cache.

Answers are most of a draft build (one target pass per token per batch); training a recipe
is the rest. So the answers are cached in one file per key of the target's version and every
parameter that decides them (``AnswerSpec``): a second build that only changes the training
recipe reads them back, and gives the same draft bitwise as the first.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple, cast

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
)

from engine.training.demo.prompts import DistillationPrompt
from engine.training.heads.data import left_padded

Progress = Callable[[str, int, int, float], None]


class TokenPrompt(NamedTuple):
    """A prompt already tokenized (chat template applied), answered as it is."""

    kind: str
    ids: list[int]


Prompt = DistillationPrompt | TokenPrompt

# Longer prompts are cut from the left: prefill would take the budget the answers need.
MAX_PROMPT_TOKENS = 256


@dataclass(frozen=True)
class AnswerSpec:
    """Everything that decides the target's answers, besides the target itself."""

    prompts: int
    answer_tokens: int
    generation_batch: int
    teacher_top_k: int
    seed: int


@dataclass(frozen=True)
class Sample:
    """A prompt, the target's greedy answer to it, and at every answer position the target's
    ``teacher_top_k`` most likely tokens (``top_ids[i, 0]`` is ``answer[i]``) with their
    log-probabilities over the full vocabulary."""

    kind: str
    prompt: list[int]
    answer: list[int]
    top_ids: torch.Tensor  # (len(answer), k) int64
    top_logprobs: torch.Tensor  # (len(answer), k) float32


class TopKRecorder(LogitsProcessor):
    """Keeps the top-k log-probabilities of every step's logits and changes nothing."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.ids: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        top = scores.float().log_softmax(-1).topk(self.k, dim=-1)
        self.ids.append(top.indices)
        self.logprobs.append(top.values)
        return scores


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, limit: int) -> list[int]:
    if isinstance(prompt, TokenPrompt):
        ids = prompt.ids
    else:
        ids = cast(list[int], tokenizer.apply_chat_template(
            prompt.messages, add_generation_prompt=True, tokenize=True, return_dict=False
        ))
    return [int(i) for i in ids][-limit:]


@torch.inference_mode()
def target_answers(
    target: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase,
    chats: list[Prompt], spec: AnswerSpec, progress: Progress,
) -> list[Sample]:
    """The target's greedy answer to every prompt with its top-k distribution at each answer
    position, generated in left-padded batches (shortest prompts first)."""
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    prompts = [_prompt_ids(tokenizer, chat, MAX_PROMPT_TOKENS) for chat in chats]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    samples: dict[int, Sample] = {}
    for start in range(0, len(order), spec.generation_batch):
        batch = order[start : start + spec.generation_batch]
        ids, mask = left_padded([prompts[i] for i in batch], pad)
        width = ids.shape[1]
        recorder = TopKRecorder(spec.teacher_top_k)
        out = target.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=spec.answer_tokens,
            do_sample=False, pad_token_id=pad, eos_token_id=eos,
            logits_processor=LogitsProcessorList([recorder]),
        )[:, width:]
        top_ids, top_logprobs = torch.stack(recorder.ids, 1), torch.stack(recorder.logprobs, 1)
        for row, i in enumerate(batch):
            answer = out[row].tolist()
            if eos in answer:
                answer = answer[: answer.index(eos) + 1]
            n = len(answer)
            samples[i] = Sample(
                chats[i].kind, prompts[i], answer, top_ids[row, :n].clone(),
                top_logprobs[row, :n].clone(),
            )
        progress("answers", start + len(batch), len(order), 0.0)
    return [samples[i] for i in range(len(prompts))]


def cache_path(
    directory: Path, target_version: str, spec: AnswerSpec, chats: list[Prompt]
) -> Path:
    """The file holding the answers of the target ``target_version`` to ``chats`` under
    ``spec``: the prompts themselves are in the key, so a changed corpus never reads back
    another corpus's answers."""
    prompts = [list(chat) for chat in chats]
    parts = [target_version, asdict(spec), MAX_PROMPT_TOKENS, prompts]
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]
    return directory / f"answers-{key}.safetensors"


def save_samples(samples: list[Sample], path: Path) -> None:
    """One safetensors file: the top-k rows of all samples concatenated, and the kinds,
    prompts and answers (which say where each sample's rows are) in its metadata; written
    atomically."""
    records = [[s.kind, s.prompt, s.answer] for s in samples]
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".partial")
    save_file(
        {"top_ids": torch.cat([s.top_ids for s in samples]).contiguous(),
         "top_logprobs": torch.cat([s.top_logprobs for s in samples]).contiguous()},
        str(staging), metadata={"samples": json.dumps(records)},
    )
    staging.replace(path)


def load_samples(path: Path) -> list[Sample]:
    """The samples ``save_samples`` wrote, in order."""
    with safe_open(str(path), framework="pt") as handle:
        records = json.loads(handle.metadata()["samples"])
    tensors = load_file(str(path))
    samples, at = [], 0
    for kind, prompt, answer in records:
        n = len(answer)
        samples.append(Sample(
            kind, prompt, answer, tensors["top_ids"][at : at + n].clone(),
            tensors["top_logprobs"][at : at + n].clone(),
        ))
        at += n
    return samples


def cached_answers(
    target: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase,
    chats: list[Prompt], spec: AnswerSpec, progress: Progress,
    target_version: str, cache_dir: Path | None,
) -> tuple[list[Sample], bool]:
    """``target_answers``, read back from ``cache_dir`` when an earlier build wrote them for
    the same target version and ``spec`` (and written there otherwise); the flag says
    whether they were read back."""
    path = None if cache_dir is None else cache_path(cache_dir, target_version, spec, chats)
    if path is not None and path.is_file():
        return load_samples(path), True
    samples = target_answers(target, tokenizer, chats, spec, progress)
    if path is not None:
        save_samples(samples, path)
    return samples, False
