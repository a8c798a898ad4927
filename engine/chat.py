"""Chat messages to prompt text with the model's own chat template.

A checkpoint without a template (many base models) cannot serve chat: that is the
client's request meeting this model, so it is an ``InvalidRequestError`` naming the
problem, as is a template that refuses the messages (one that insists on alternating roles,
say), never a server error.
"""

from __future__ import annotations

from collections.abc import Sequence

from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from engine.types import InvalidRequestError, NoChatTemplateError


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> str:
    """The prompt text for ``messages``, with the generation prompt added."""
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError(
            "This model has no chat template (none in its tokenizer files), so it cannot "
            "serve chat completions; send a plain prompt to /v1/completions instead.",
            "messages",
        )
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
    except TemplateError as error:
        raise InvalidRequestError(
            f"The model's chat template refused these messages: {error}", "messages"
        ) from error
    assert isinstance(text, str)
    return text
