"""The hand-wired induction circuit: an untrained model with it copies, one without does not."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from engine.demo.induction import wire_induction_circuit
from engine.demo.training import ROPE_THETA

VOCAB = 4096


def untrained(layers: int = 2, hidden: int = 192, vocab: int = VOCAB) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
    )
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def wired() -> LlamaForCausalLM:
    model = untrained()
    wire_induction_circuit(model, torch.Generator().manual_seed(1))
    return model


def repeated(seed: int, span: int, length: int, vocab: int = VOCAB) -> torch.Tensor:
    """Random tokens ending in a random span written twice."""
    generator = torch.Generator().manual_seed(seed)
    segment = torch.randint(0, vocab, (span,), generator=generator)
    head = torch.randint(0, vocab, (length - 2 * span,), generator=generator)
    return torch.cat([head, segment, segment])[None]


@torch.no_grad()
def copy_accuracy(model: LlamaForCausalLM, ids: torch.Tensor, span: int) -> float:
    """Share of the second copy's tokens (after its first) the model predicts greedily."""
    predicted = model(input_ids=ids).logits.argmax(-1)[0, -span:-1]
    return float((predicted == ids[0, -span + 1 :]).float().mean())


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), span=st.integers(20, 200))
def test_wired_untrained_model_copies_a_repeated_span(
    wired: LlamaForCausalLM, seed: int, span: int
) -> None:
    assert copy_accuracy(wired, repeated(seed, span, 512), span) >= 0.9


def test_unwired_untrained_model_does_not_copy() -> None:
    assert copy_accuracy(untrained(), repeated(3, 100, 512), 100) < 0.05


def test_circuit_survives_untrained_layers_above_it() -> None:
    model = untrained(layers=12)
    wire_induction_circuit(model, torch.Generator().manual_seed(1))
    assert copy_accuracy(model, repeated(4, 100, 512), 100) >= 0.9


@torch.no_grad()
def test_previous_token_heads_attend_one_and_two_tokens_back(wired: LlamaForCausalLM) -> None:
    ids = torch.randint(0, VOCAB, (1, 1024), generator=torch.Generator().manual_seed(2))
    attention = wired(input_ids=ids, output_attentions=True).attentions[0][0]
    positions = torch.arange(2, 1024)
    assert float(attention[0, positions, positions - 1].min()) > 0.9
    assert float(attention[1, positions, positions - 2].min()) > 0.9


def test_small_shape_of_the_quick_build_copies_too() -> None:
    model = untrained(hidden=64, vocab=384)
    wire_induction_circuit(model, torch.Generator().manual_seed(1))
    assert copy_accuracy(model, repeated(5, 40, 200, vocab=384), 40) >= 0.6


def test_refuses_a_model_without_room_for_the_circuit() -> None:
    with pytest.raises(ValueError, match="two layers"):
        wire_induction_circuit(untrained(layers=1), torch.Generator())
