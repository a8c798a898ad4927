"""Grammar masks for constrained decoding, on llguidance (docs/agent-api.md says why).

``Grammars`` holds what one tokenizer needs (llguidance's token table, built at the first
constrained request) and turns a request's ``Constraint`` into a grammar; a bad schema, regex
or grammar is the client's error (``InvalidRequestError``). A ``GrammarMatcher`` follows one
request: it is kept at the committed output (``commit``) and, to mask a pass's rows, advances
through each row's path beyond it and rolls back to where the next row's path parts from the
current one (llguidance's ``rollback``). A row whose path the grammar refuses can never be
reached (verification rejects the refused token before it), so its logits are left as
they are; refused tokens are found with ``validate_tokens`` first, since consuming one would
put the matcher in its error state for good. The grammar text itself comes from
``engine.api.grammar_text``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from transformers import PreTrainedTokenizerBase

from engine.api.grammar_text import checked_grammar
from engine.api.types import Constraint, InvalidRequestError


class Grammars:
    """Grammars for one tokenizer and a model with ``vocab_size`` logits."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, end_ids: frozenset[int]
    ) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._end_ids = sorted(end_ids)
        self._table: Any = None
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Build the token table now (the engine does this on a background thread at load:
        for the demo's 49,152 ids it takes about two seconds, which the first constrained
        request would otherwise wait for). A tokenizer llguidance cannot read is reported to
        the constrained requests themselves (``compile``), so nothing is raised here."""
        with contextlib.suppress(Exception):
            self._token_table()

    def _token_table(self) -> Any:
        with self._lock:
            if self._table is None:
                self._table = llguidance.hf.from_tokenizer(
                    self._tokenizer,  # type: ignore[arg-type]
                    n_vocab=self.vocab_size,
                    eos_token=self._end_ids or None,
                )
            return self._table

    def compile(self, constraint: Constraint) -> str:
        """The checked grammar of ``constraint`` (InvalidRequestError when it has none)."""
        try:
            table = self._token_table()
        except Exception as error:  # a tokenizer llguidance cannot read: this model cannot
            raise InvalidRequestError(  # serve constraints, which is this request's answer
                f"This model's tokenizer does not support constrained decoding ({error}).",
                "response_format",
            ) from error
        return checked_grammar(constraint, table)

    def matcher(self, grammar: str) -> GrammarMatcher:
        return GrammarMatcher(
            llguidance.LLMatcher(self._token_table(), grammar), self.vocab_size, self._end_ids
        )


class GrammarMatcher:
    """One request's position in its grammar: the committed output plus ``pending`` tokens
    accepted beyond it while masking."""

    def __init__(self, matcher: Any, vocab_size: int, end_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._end_ids = torch.tensor(list(end_ids), dtype=torch.long)
        self._pending: list[int] = []
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def commit(self, tokens: Sequence[int]) -> None:
        """``tokens`` follow the committed output now."""
        self._move_to(tokens)
        self._pending = []

    def _move_to(self, path: Sequence[int]) -> bool:
        """Accept ``path`` beyond the committed output, reusing what is accepted already;
        False (stopped before the refused token) when the grammar refuses part of it."""
        common = 0
        limit = min(len(path), len(self._pending))
        while common < limit and self._pending[common] == path[common]:
            common += 1
        if len(self._pending) > common:
            self._matcher.rollback(len(self._pending) - common)
            del self._pending[common:]
        rest = list(path[common:])
        if not rest:
            return True
        valid = 0 if self._matcher.is_stopped() else self._matcher.validate_tokens(rest)
        if valid:
            self._matcher.consume_tokens(rest[:valid])
            self._pending.extend(rest[:valid])
        return valid == len(rest)

    def mask(self, logits: torch.Tensor, paths: Sequence[Sequence[int]]) -> None:
        """Set to -inf, in place, the logits the grammar forbids in each row (row r's context
        is the committed output followed by ``paths[r]``)."""
        width = logits.shape[-1]
        for row, path in enumerate(paths):
            if not self._move_to(path):
                continue  # unreachable: verification stops at the refused token before it
            if self._matcher.is_stopped():
                # The grammar is complete: only the end of the sequence may follow.
                if len(self._end_ids):
                    ended = logits[row].index_select(0, self._end_ids.to(logits.device))
                    logits[row].fill_(float("-inf"))
                    logits[row].index_copy_(0, self._end_ids.to(logits.device), ended)
                continue
            llguidance.torch.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
            allowed = _allowed(self._bitmask[0], self.vocab_size).to(logits.device)
            if width > self.vocab_size:
                allowed = torch.nn.functional.pad(allowed, (0, width - self.vocab_size))
            logits[row].masked_fill_(~allowed[:width], float("-inf"))


_BITS = torch.arange(32, dtype=torch.int32)


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A packed int32 bitmask (bit i of word w: token 32w + i) as booleans."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    return bits.flatten()[:vocab_size].bool()
