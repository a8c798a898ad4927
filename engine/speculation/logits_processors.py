"""Logits processing for every fed row of a pass, for target and draft alike.

Speculation stays lossless under penalties, ``logit_bias``, ``min_tokens`` and grammar masks
only if each row's logits are processed with that row's own context: the committed output
plus the proposed tokens on the way to it (the node's ancestors). So one request's
``LogitsProcessing`` is told the committed tokens (``commit``) and processes a pass's rows
given, per row, the tokens after the committed sequence that lead to it (``apply``): penalty
counts include those tokens, ``min_tokens`` counts them, and the grammar matcher advances
through them (and rolls back to where the next row's path parts from the last one). The
decode loop applies it to the target's rows before verification; the draft proposer applies
it to its own logits before it draws, so q is processed exactly as p.

Order, per row: the grammar mask, ``allowed_token_ids``, ``bad_words``, ``min_tokens``,
``logit_bias``, then the repetition, frequency and presence penalties; temperature, min-p,
top-k and top-p follow in ``engine.speculation.sampling.probabilities``. A request with none of them
never builds one of these (``SamplingParams.processes_logits``), so plain requests pay
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.api.types import SamplingParams
from engine.speculation.grammar import GrammarMatcher


class LogitsProcessing:
    """One request's logits processors and the state they need (counts, grammar matcher)."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        vocab_size: int,
        end_ids: frozenset[int],
        device: torch.device,
        grammar: GrammarMatcher | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.device = device
        self.grammar = grammar
        self.output: list[int] = []
        self._penalised = (
            params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0
        )
        self._counts = torch.zeros(vocab_size, device=device)
        self._in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if params.repetition_penalty != 1.0 and prompt_ids:
            ids = torch.tensor([t for t in prompt_ids if t < vocab_size], dtype=torch.long)
            self._in_prompt[ids.to(device)] = True
        self._bias: torch.Tensor | None = None
        if params.logit_bias:
            self._bias = torch.zeros(vocab_size, device=device)
            for token, bias in params.logit_bias:
                if token < vocab_size:
                    self._bias[token] += bias
        self._banned: torch.Tensor | None = None
        if params.allowed_token_ids:
            self._banned = torch.ones(vocab_size, dtype=torch.bool, device=device)
            allowed = [t for t in params.allowed_token_ids if t < vocab_size]
            self._banned[torch.tensor(allowed, dtype=torch.long, device=device)] = False
        self._end_ids = torch.tensor(
            sorted(t for t in end_ids | set(params.stop_token_ids) if t < vocab_size),
            dtype=torch.long,
            device=device,
        )
        # What a row that the masks leave empty may still generate: its end tokens, and the
        # model's end-of-sequence tokens even under ignore_eos (which only keeps them from
        # ending the output).
        self._last_resort = torch.tensor(
            sorted(t for t in end_ids | eos_ids | set(params.stop_token_ids) if t < vocab_size),
            dtype=torch.long,
            device=device,
        )

    def commit(self, tokens: Sequence[int]) -> None:
        """Verification committed ``tokens`` after the output so far."""
        self.output.extend(tokens)
        if self.grammar is not None:
            self.grammar.commit(tokens)
        if self._penalised and tokens:
            ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
            self._counts.index_add_(0, ids, torch.ones(len(ids), device=self.device))

    def apply(self, logits: torch.Tensor, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """Processed copy of ``logits`` (``[rows, vocab]``, any vocab at least the processors'
        ids); row r's context is the committed output followed by ``paths[r]``."""
        out = logits.float().clone()
        vocab = min(out.shape[-1], self.vocab_size)
        if self.grammar is not None:
            self.grammar.mask(out, paths)
        if self._banned is not None or self.params.bad_words:
            unmasked = out.clone()
            if self._banned is not None:
                out[:, :vocab].masked_fill_(self._banned[:vocab], float("-inf"))
                out[:, self.vocab_size :] = float("-inf")
            if self.params.bad_words:
                self._ban_words(out, paths)
            self._end_where_nothing_is_left(out, unmasked)
        if self.params.min_tokens > 0:
            self._forbid_ending(out, paths)
        if self._bias is not None:
            out[:, :vocab] += self._bias[:vocab]
        if self._penalised:
            self._penalise(out[:, :vocab], paths)
        return out

    def _ban_words(self, out: torch.Tensor, paths: Sequence[Sequence[int]]) -> None:
        """Mask each bad word's last token in every row whose output (committed tokens, then
        the row's path) ends with the word's other tokens (vLLM's rule)."""
        for row, path in enumerate(paths):
            context = [*self.output, *path]
            for word in self.params.bad_words:
                *head, last = word
                if last < out.shape[-1] and (not head or context[-len(head) :] == head):
                    out[row, last] = float("-inf")

    def _end_where_nothing_is_left(self, out: torch.Tensor, unmasked: torch.Tensor) -> None:
        """A row where ``allowed_token_ids``, ``bad_words`` and the grammar leave no token
        gets its end-of-sequence and stop tokens let through, equally likely, so the output
        ends there (unless ``ignore_eos``); a model with none of them keeps the row as the
        two masks found it. Either is a rule of the row's own context, so target and
        proposer apply it alike, and no row is ever left without a token to draw."""
        for row in range(out.shape[0]):
            if torch.isfinite(out[row].amax()):
                continue
            if len(self._last_resort) > 0:
                out[row].index_fill_(0, self._last_resort, 0.0)
            else:
                out[row].copy_(unmasked[row])

    def _forbid_ending(self, out: torch.Tensor, paths: Sequence[Sequence[int]]) -> None:
        """No end-of-sequence or stop token before ``min_tokens`` output tokens; where the
        grammar allows nothing else (a finished JSON value), the grammar wins."""
        for row, path in enumerate(paths):
            if len(self.output) + len(path) >= self.params.min_tokens:
                continue
            kept = out[row].index_select(0, self._end_ids)
            out[row].index_fill_(0, self._end_ids, float("-inf"))
            if not torch.isfinite(out[row].amax()):
                out[row].index_copy_(0, self._end_ids, kept)

    def _penalise(self, out: torch.Tensor, paths: Sequence[Sequence[int]]) -> None:
        params = self.params
        vocab = out.shape[-1]
        counts = self._counts[:vocab].expand(len(paths), vocab).clone()
        for row, path in enumerate(paths):
            if path:
                ids = torch.tensor(list(path), dtype=torch.long, device=self.device)
                counts[row].index_add_(0, ids, torch.ones(len(ids), device=self.device))
        if params.repetition_penalty != 1.0:
            seen = (counts > 0) | self._in_prompt[:vocab]
            penalty = params.repetition_penalty
            scaled = torch.where(out > 0, out / penalty, out * penalty)
            out.copy_(torch.where(seen, scaled, out))
        if params.frequency_penalty != 0.0:
            out.sub_(params.frequency_penalty * counts)
        if params.presence_penalty != 0.0:
            out.sub_(params.presence_penalty * (counts > 0).float())


def proposal_paths(
    tokens: Sequence[int], parents: Sequence[int] | None
) -> list[list[int]]:
    """Each fed row's path for a proposal tree (``parents`` None: a chain): row 0 has none,
    row i + 1 the tokens from the root child down to node i, itself included."""
    if parents is None:
        return chain_paths(tokens)
    paths: list[list[int]] = [[]]
    for i, parent in enumerate(parents):
        paths.append([*(paths[parent + 1] if parent >= 0 else []), tokens[i]])
    return paths


def chain_paths(tokens: Sequence[int]) -> list[list[int]]:
    """Each fed row's path for a chain proposal: row 0 (the last committed token) has none,
    row i+1 has the proposal's first i+1 tokens."""
    return [list(tokens[:i]) for i in range(len(tokens) + 1)]
