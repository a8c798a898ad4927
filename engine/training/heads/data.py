"""What heads learn from: the frozen target's own tokens, features and distributions.

The target answers chat prompts (the demo's distillation prompts, engine.training.demo.prompts) and
continues text snippets, greedily: its own tokens, the ones greedy speculation must propose.
One teacher-forced pass over each finished sequence then gives, at every position, the
feature the heads read (the input of the target's LM head) and, through that head, the
target's whole next-token distribution (soft labels), for the price of a prefill. Answers are
the costly part (one target pass per token per batch), so they are cached by a key of the
target's version and everything that decides them: the same request reads them back.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

Progress = Callable[[str, int, int, float], None]
Messages = list[dict[str, str]]
# Prompts are cut from the left beyond this many tokens (prefill would take the answers' time).
MAX_PROMPT_TOKENS = 256


@dataclass(frozen=True)
class DataSpec:
    """How much the target writes: ``answer_tokens`` per chat prompt and per snippet of
    ``prompt_tokens`` tokens (``snippets`` of them, cut at seeded offsets)."""

    snippets: int = 256
    prompt_tokens: int = 64
    answer_tokens: int = 96
    generation_batch: int = 32
    seed: int = 0


@dataclass(frozen=True)
class _Written:
    ids: list[int]
    own_from: int  # the first position whose token the target wrote itself


@dataclass
class Distillation:
    """Right-padded sequences ``ids`` ``[n, length]``, their true ``lengths`` ``[n]``, the
    first position of the target's own tokens in each (``own_from``), and the target's
    features at every position ``hidden`` ``[n, length, hidden]`` (float32)."""

    ids: torch.Tensor
    lengths: torch.Tensor
    own_from: torch.Tensor
    hidden: torch.Tensor

    @property
    def own_tokens(self) -> list[list[int]]:
        """The tokens the target wrote, per sequence."""
        return [
            self.ids[i, int(self.own_from[i]) : int(self.lengths[i])].tolist()
            for i in range(self.ids.shape[0])
        ]

    @property
    def positions(self) -> int:
        return int(self.lengths.sum())


def snippets(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], spec: DataSpec
) -> list[list[int]]:
    """``spec.snippets`` prompts of ``spec.prompt_tokens`` tokens at seeded offsets."""
    if not texts or spec.snippets == 0:
        return []
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


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, chats: Sequence[Messages]
) -> list[list[int]]:
    out = []
    for chat in chats:
        ids = tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        out.append([int(i) for i in cast(list[int], ids)][-MAX_PROMPT_TOKENS:])
    return out


@torch.inference_mode()
def left_padded(prompts: Sequence[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` as one left-padded batch for ``generate``: ids and attention mask."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def greedy_answers(
    target: PreTrainedModel, prompts: list[list[int]], spec: DataSpec, eos: int | None,
    pad: int, progress: Progress, until_end: bool = True,
) -> list[list[int]]:
    """The target's greedy answer to each prompt (up to and with ``eos``), generated in
    left-padded batches of similar length; ``until_end`` False: continuations of
    ``answer_tokens`` tokens each (a text snippet has no end of its own)."""
    if not prompts:
        return []
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    answers: dict[int, list[int]] = {}
    for start in range(0, len(order), spec.generation_batch):
        batch = order[start : start + spec.generation_batch]
        ids, mask = left_padded([prompts[i] for i in batch], pad)
        width = ids.shape[1]
        out = target.generate(  # type: ignore[operator]
            input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
            max_new_tokens=spec.answer_tokens,
            min_new_tokens=0 if until_end else spec.answer_tokens, do_sample=False,
            pad_token_id=pad, eos_token_id=eos,
        )[:, width:]
        for row, i in enumerate(batch):
            answer = out[row].tolist()
            if until_end and eos is not None and eos in answer:
                answer = answer[: answer.index(eos) + 1]
            answers[i] = answer
        progress("answers", start + len(batch), len(order), 0.0)
    return [answers[i] for i in range(len(prompts))]


@torch.inference_mode()
def features(target: PreTrainedModel, sequences: list[list[int]], batch: int = 8) -> torch.Tensor:
    """The input of the target's LM head at every position of right-padded ``sequences``,
    ``[n, longest, hidden]`` float32 (padding rows are garbage; callers mask them): the base
    model's last hidden state (after its final norm), without the LM head's pass over every
    position, which would cost more than the rest of the model."""
    longest = max(len(s) for s in sequences)
    # Batches of similar length, each padded to its own longest.
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i]), i))
    out_rows = torch.zeros((len(sequences), longest, _hidden_size(target)))
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        chunk = [sequences[i] for i in rows]
        width = max(len(s) for s in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(chunk):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        # Right padding under a causal mask leaves every real position as it is alone.
        out = target.base_model(
            input_ids=ids.to(target.device), attention_mask=mask.to(target.device)
        )
        out_rows[rows, :width] = out.last_hidden_state.float().cpu()
    return out_rows


def _hidden_size(target: PreTrainedModel) -> int:
    return int(target.config.hidden_size)


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


class _AnswerCache:
    """The target's answers by prompt, in one JSON file per target version and answer length
    (a run with fewer or more prompts reuses what an earlier one wrote)."""

    def __init__(
        self, directory: Path | None, target_version: str, spec: DataSpec, eos: int | None
    ):
        self.path = (
            None
            if directory is None
            else directory / f"answers-{_key(target_version, spec.answer_tokens, eos)}.json"
        )
        self.known: dict[str, list[int]] = (
            json.loads(self.path.read_text()) if self.path and self.path.is_file() else {}
        )

    @staticmethod
    def key(prompt: list[int], until_end: bool) -> str:
        return _key(prompt, until_end)

    def missing(self, prompts: list[list[int]], until_end: bool) -> list[list[int]]:
        return [p for p in prompts if self.key(p, until_end) not in self.known]

    def add(self, prompts: list[list[int]], answers: list[list[int]], until_end: bool) -> None:
        for prompt, answer in zip(prompts, answers, strict=True):
            self.known[self.key(prompt, until_end)] = answer
        if self.path is not None and prompts:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.known))

    def answers(self, prompts: list[list[int]], until_end: bool) -> list[list[int]]:
        return [self.known[self.key(p, until_end)] for p in prompts]


def distillation_data(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    target_version: str,
    spec: DataSpec,
    progress: Progress,
    texts: Sequence[str] = (),
    chats: Sequence[Messages] = (),
    cache_dir: Path | None = None,
    prompts: Sequence[Sequence[int]] = (),
) -> Distillation:
    """The target's answers to ``chats`` and to ``prompts`` (token ids already in the chat
    template, as a recorded request's), and continuations of snippets of ``texts``, with its
    features at every position. With ``cache_dir``, answers already written for the same
    target version and prompts are read back instead of generated."""
    target.eval()
    eos = tokenizer.eos_token_id
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos or 0)
    asked = chat_prompt_ids(tokenizer, chats) + [
        [int(i) for i in prompt][-MAX_PROMPT_TOKENS:] for prompt in prompts
    ]
    cut = snippets(tokenizer, texts, spec)
    if not asked + cut:
        raise ValueError("no chat prompts and no text to distil on")
    cache = _AnswerCache(cache_dir, target_version, spec, eos)
    torch.manual_seed(spec.seed)
    for group, until_end in ((asked, True), (cut, False)):
        todo = cache.missing(group, until_end)
        if todo:
            written = greedy_answers(target, todo, spec, eos, pad, progress, until_end=until_end)
            cache.add(todo, written, until_end)
    answers = cache.answers(asked, True) + cache.answers(cut, False)
    kept = [
        _Written(prompt + answer, len(prompt))
        for prompt, answer in zip(asked + cut, answers, strict=True)
        if len(answer) >= 2
    ]
    ids = [s.ids for s in kept]
    longest = max(len(s) for s in ids)
    padded = torch.full((len(ids), longest), pad, dtype=torch.long)
    for row, seq in enumerate(ids):
        padded[row, : len(seq)] = torch.tensor(seq)
    return Distillation(
        ids=padded,
        lengths=torch.tensor([len(s) for s in ids]),
        own_from=torch.tensor([s.own_from for s in kept]),
        hidden=_cached_features(target, ids, cache_dir, target_version, progress),
    )


def _cached_features(
    target: PreTrainedModel, sequences: list[list[int]], cache_dir: Path | None,
    target_version: str, progress: Progress,
) -> torch.Tensor:
    """``features``, read back from ``cache_dir`` when computed before for these sequences
    (the second method trained on the same data skips the pass)."""
    name = f"features-{_key(target_version, sequences)}.safetensors"
    path = None if cache_dir is None else cache_dir / name
    if path is not None and path.is_file():
        return load_file(str(path))["hidden"]
    hidden = features(target, sequences)
    progress("features", len(sequences), len(sequences), 0.0)
    if path is not None:
        save_file({"hidden": hidden.contiguous()}, str(path))
    return hidden
