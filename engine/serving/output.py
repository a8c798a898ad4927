"""Turn committed tokens into output: end-of-sequence, stop tokens, max_tokens, stop strings,
and streaming text deltas that never show part of a stop string or a half UTF-8 character.

Every method feeds the same assembler, so generation ends at exactly the token where plain
decoding would, however many tokens a speculative step committed past it.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from engine.api.types import FinishReason, SamplingParams

# Prompt tokens decoded in front of the output so that tokenizers which drop a leading space
# when decoding a sequence on its own (SentencePiece) still produce the right text.
_PREFIX_TOKENS = 4


@dataclass(frozen=True)
class Piece:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None


class OutputAssembler:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        prompt_ids: list[int],
        eos_token_ids: frozenset[int],
    ) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.end_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids
        )
        self.prefix = prompt_ids[-_PREFIX_TOKENS:]
        self.prefix_text = self._decode_raw(self.prefix)
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of self.text already handed out
        self.longest_stop = max((len(s) for s in params.stop), default=0)

    def _decode_raw(self, ids: list[int]) -> str:
        skip = self.params.skip_special_tokens
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip))

    def _decode(self, ids: list[int]) -> str:
        return self._decode_raw(self.prefix + ids)[len(self.prefix_text) :]

    def add(self, tokens: list[int]) -> Piece:
        """Consume tokens committed by one step; returns what to emit and whether it ended."""
        finish: FinishReason | None = None
        kept: list[int] = []
        for token in tokens:
            if token in self.end_ids:
                finish = "stop"
                if self.params.include_stop_str_in_output:
                    kept.append(token)
                break
            kept.append(token)
            if len(self.token_ids) + len(kept) >= self.params.max_tokens:
                finish = "length"
                break
        before = len(self.token_ids)
        self.token_ids.extend(kept)
        if kept:
            self.text = self._decode(self.token_ids)
        if self.params.stop and kept and self._cut_at_stop_string(before):
            finish = "stop"
        end = len(self.text) if finish else len(self.text) - self._held_back()
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return Piece(self.token_ids[before:], delta, finish)

    def _first_stop(self, text: str, search_from: int) -> int | None:
        found = [i for s in self.params.stop if (i := text.find(s, search_from)) >= 0]
        return min(found) if found else None

    def _cut_at_stop_string(self, before: int) -> bool:
        """If the new tokens complete a stop string, end at the token that completes it."""
        search_from = max(0, self.emitted - self.longest_stop)
        if self._first_stop(self.text, search_from) is None:
            return False
        for end in range(before + 1, len(self.token_ids) + 1):
            text = self._decode(self.token_ids[:end])
            cut = self._first_stop(text, search_from)
            if cut is not None:
                del self.token_ids[end:]
                self.text = text[: self._stop_end(text, cut)]
                return True
        raise AssertionError("stop string found in the whole text but in no prefix of it")

    def _stop_end(self, text: str, cut: int) -> int:
        """Where the output's text ends when a stop string starts at ``cut``: there, or
        after the (longest such) stop string with ``include_stop_str_in_output``."""
        if not self.params.include_stop_str_in_output:
            return cut
        return cut + max(len(s) for s in self.params.stop if text.startswith(s, cut))

    def _held_back(self) -> int:
        """Characters at the end that may still turn into a stop string or a full character."""
        text = self.text
        held = len(text) - len(text.rstrip("\ufffd"))
        for size in range(min(self.longest_stop, len(text)), 0, -1):
            tail = text[len(text) - size :]
            if any(s.startswith(tail) for s in self.params.stop):
                return max(held, size)
        return held
