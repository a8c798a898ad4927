"""vLLM's ``/tokenize`` and ``/detokenize``: shapes, and the token counts generation sees.

A prompt is tokenized exactly as ``/v1/completions`` tokenizes it, and chat messages are
rendered with the same chat template (tools and template options included) as
``/v1/chat/completions`` renders them, through the same functions, so a count here is the
``prompt_tokens`` a generation of the same input reports.

No audit event: nothing is generated, and nothing is kept. The audit log records
generations (keyed commitments to their prompts and outputs, never the text); tokenizing is
a pure function of the text and the served tokenizer, whose version every `request` event
already records.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.backends.base import GenerationBackend
from gateway.errors import APIError
from gateway.generation.job import chat_prompt, completion_prompt
from gateway.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, Tool


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizePromptRequest(_Strict):
    model: str
    prompt: str
    add_special_tokens: Literal[True] = Field(
        default=True, description="Only true: the tokens a completion of this prompt sees."
    )


class TokenizeChatRequest(_Strict):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


# ``{"model", "prompt"}`` or ``{"model", "messages"}``, as vLLM takes them.
TokenizeRequest = TokenizePromptRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Strict):
    model: str
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(
    body: TokenizeRequest,
    backend: GenerationBackend,
    max_prompt_bytes: int,
) -> TokenizeResponse:
    """CPU work (templating, tokenizing): call it off the event loop. ``backend``: the
    model's the request names."""
    if isinstance(body, TokenizePromptRequest):
        completion = CompletionRequest(model=body.model, prompt=body.prompt)
        prompt = completion_prompt(completion, backend, max_prompt_bytes)
    else:
        chat = ChatCompletionRequest(
            model=body.model,
            messages=body.messages,
            tools=body.tools,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        prompt = chat_prompt(chat, backend, max_prompt_bytes)
    tokens = list(prompt.token_ids)
    return TokenizeResponse(
        count=len(tokens), max_model_len=backend.card.max_context, tokens=tokens
    )


def detokenize(body: DetokenizeRequest, backend: GenerationBackend) -> DetokenizeResponse:
    card = backend.card
    if any(token < 0 or token >= card.vocab_size for token in body.tokens):
        raise APIError(400, f"Token ids must lie in [0, {card.vocab_size}).", param="tokens")
    return DetokenizeResponse(prompt=backend.detokenize(body.tokens))
