"""The served model's tokenizer beside the gateway, used only where it answers as vLLM does.

Each chat request needs its prompt's token ids (sent to vLLM) and its text as rendered (the
`request` event commits to it, docs/compliance.md). vLLM's ``/tokenize`` renders the chat
template and returns the ids only; its ``/detokenize`` is ``tokenizer.decode`` of them on the
server, a second synchronous round trip that also loads vLLM's API server. A completion's
prompt costs a ``/tokenize`` of its own.

Where a vLLM server is configured with a ``model_dir`` (the directory of the weights it
serves, visible to the gateway for the manifest), the gateway loads the same tokenizer files
and, once at start-up, checks them against the server on a probe: the probe text's ids from
``/tokenize`` and, decoded, those ids with every special token from ``/detokenize``. Only if
both agree does the gateway decode chat prompts and tokenize completion prompts itself; the
template is still rendered by the server, so the ids stay the server's own. The recorded text
is the same either way (the server's decode and the gateway's are the same function of the
same files); a tokenizer that disagrees (a server started with ``--tokenizer``, another
revision) is not used, and the gateway keeps asking the server.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog
from transformers import AutoTokenizer, PreTrainedTokenizerBase

log = structlog.get_logger(__name__)

# Spaces, tabs, newlines, markup, non-Latin and astral characters: where decoders differ.
PROBE_TEXT = "Grüße  aus\tZürich,\n\n世界! 🙂 <b>a&amp;b</b>  \n def f(x):\n    return x ** 2\n"


class LocalTokenizer:
    """Encode and decode with the model's own tokenizer files; one call at a time (a fast
    tokenizer shared between threads can fail with "Already borrowed")."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()

    @classmethod
    def load(cls, model_dir: Path) -> LocalTokenizer | None:
        """The tokenizer in ``model_dir``; None (logged) when it has none that loads."""
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as error:
            log.warning("vllm_local_tokenizer_unusable", model_dir=str(model_dir), error=str(error))
            return None
        return cls(tokenizer)

    @property
    def special_ids(self) -> tuple[int, ...]:
        return tuple(int(i) for i in self._tokenizer.all_special_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """A completion prompt's ids, special tokens added, as vLLM's ``/tokenize`` gives
        (``add_special_tokens`` False: a fragment's)."""
        with self._lock:
            return tuple(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, special tokens kept, as vLLM's ``/detokenize`` gives."""
        with self._lock:
            return str(self._tokenizer.decode(list(token_ids)))


def disagreement(
    local: LocalTokenizer,
    server_tokenize: Callable[[str], Sequence[int]],
    server_detokenize: Callable[[Sequence[int]], str],
) -> str | None:
    """How ``local`` answers the probe otherwise than the server, or None where it agrees."""
    ids = tuple(server_tokenize(PROBE_TEXT))
    if local.encode(PROBE_TEXT) != ids:
        return "the probe text's token ids differ"
    probe = (*ids, *local.special_ids, *ids)
    if local.decode(probe) != server_detokenize(probe):
        return "the probe ids' text differs"
    return None
