"""The prompts a benchmark runs: the built-in held-out sets, or an operator's own file.

A prompt file holds JSON lines, each a completion request ``{"prompt": "..."}`` or a chat
request ``{"messages": [...]}``, optionally with ``"max_tokens"``. The built-in sets are the
workloads of an instruct model, written apart from the demo draft's distillation prompts
(``engine.training.demo.prompts``), with code only from standard-library files the demo holds out
(``source`` names the file and function): ``chat`` asks everyday questions, ``code`` asks to
finish a function given its first lines, ``editing`` asks to quote a function back or rename
it (where n-gram lookup shines), ``json`` asks to extract fields from a short text as JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from engine.api.types import SamplingParams

BUILTIN_DIR = Path(__file__).parent / "prompts"
BUILTIN_SETS = ("chat", "code", "editing", "json")


@dataclass(frozen=True)
class BenchPrompt:
    workload: str
    name: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    # The Specgate variants' sampling parameters (None: greedy, max_tokens).
    sampling: SamplingParams | None = None


def encode_request(request: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The prompt token ids of a chat (``messages``) or completion (``prompt``) request body."""
    if "messages" in request:
        encoded = tokenizer.apply_chat_template(
            request["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return [int(i) for i in cast(list[int], encoded)]
    if "prompt" in request:
        return [int(i) for i in tokenizer.encode(request["prompt"], add_special_tokens=False)]
    raise ValueError("each line needs a 'prompt' (completion) or 'messages' (chat) field")


def load_prompts(
    path: Path, workload: str, tokenizer: PreTrainedTokenizerBase, max_tokens: int, limit: int
) -> list[BenchPrompt]:
    """Read up to ``limit`` requests from a JSON-lines file and tokenize them."""
    prompts: list[BenchPrompt] = []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for number, line in enumerate(lines[:limit], start=1):
        try:
            request = json.loads(line)
            ids = encode_request(request, tokenizer)
        except (json.JSONDecodeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
        name = str(request.get("source") or f"{path.name}:{number}")
        prompts.append(
            BenchPrompt(workload, name, tuple(ids), int(request.get("max_tokens", max_tokens)))
        )
    return prompts


def builtin_prompts(
    tokenizer: PreTrainedTokenizerBase, max_tokens: int, limit: int
) -> list[BenchPrompt]:
    return [
        prompt
        for workload in BUILTIN_SETS
        for prompt in load_prompts(
            BUILTIN_DIR / f"{workload}.jsonl", workload, tokenizer, max_tokens, limit
        )
    ]
