"""Log-probabilities of the output tokens, from the target's processed logits.

At each committed position the decode loop hands over the target's logits after the logits
processors (penalties, bias, grammar mask) and before temperature, top-k and top-p, the row
that verification judged the committed token by. Those rows are the same whether the token
came from a proposal or from a plain step, so logprobs agree between speculative and plain
decoding (up to float rounding of a pass over several tokens), and never come from the draft.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from engine.api.types import TokenLogprob


class LogprobRecorder:
    """One request's logprobs, one entry per committed token, ``top`` alternatives each."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, top: int) -> None:
        self.tokenizer = tokenizer
        self.top = top
        self.entries: list[TokenLogprob] = []

    def observe(self, logits: torch.Tensor, tokens: list[int]) -> None:
        """``logits[i]`` is the processed row the committed ``tokens[i]`` was chosen from."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
        if self.top:
            values, ids = torch.topk(logprobs, self.top, dim=-1)
            tops = [
                list(zip(row_ids, row_values, strict=True))
                for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
            ]
        else:
            tops = [[] for _ in tokens]
        for token, logprob, alternatives in zip(tokens, chosen.tolist(), tops, strict=True):
            text, raw = self._text(token)
            self.entries.append(
                TokenLogprob(
                    token,
                    text,
                    raw,
                    _finite(logprob),
                    tuple((*self._text(t), _finite(v)) for t, v in alternatives),
                )
            )

    def take(self, start: int, end: int) -> tuple[TokenLogprob, ...]:
        """Entries of output tokens ``start`` to ``end`` (the output is a prefix of what was
        committed: the end-of-sequence token and anything after a stop are not output)."""
        return tuple(self.entries[start:end])

    def _text(self, token: int) -> tuple[str, tuple[int, ...]]:
        text = str(self.tokenizer.decode([token]))
        return text, tuple(text.encode("utf-8"))


# OpenAI reports tokens that cannot occur with this floor rather than -inf (JSON has no inf).
LOGPROB_FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR
