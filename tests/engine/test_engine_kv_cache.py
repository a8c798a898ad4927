"""The growable KV cache and the CPU grouped-head attention against transformers' own."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicSlidingWindowLayer

from engine.models import kv_cache
from engine.models.attention import CPU_GQA_SDPA, use_cpu_gqa_attention
from engine.models.kv_cache import GrowableLayer, new_cache

# Each operation appends that many positions (> 0) or drops that many (< 0).
operations = st.lists(st.integers(min_value=-12, max_value=40), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(ops=operations)
def test_appends_and_rollbacks_match_a_growing_tensor(ops: list[int]) -> None:
    layer = GrowableLayer()
    expected = torch.empty(1, 2, 0, 4)
    counter = 0
    for op in ops:
        if op > 0:
            new = torch.arange(counter, counter + op * 8, dtype=torch.float32).view(1, 2, op, 4)
            counter += op * 8
            keys, values = layer.update(new, -new)
            expected = torch.cat([expected, new], dim=2)
            assert torch.equal(keys, expected) and torch.equal(values, -expected)
        else:
            drop = min(-op, expected.shape[2])
            layer.crop(-drop)
            expected = expected[:, :, : expected.shape[2] - drop]
        assert layer.get_seq_length() == expected.shape[2]
        assert layer.get_mask_sizes(3) == (expected.shape[2] + 3, 0)


def test_growth_keeps_the_prefix_and_doubles_the_room() -> None:
    layer = GrowableLayer()
    first = torch.randn(1, 2, kv_cache.INITIAL_CAPACITY, 4)
    layer.update(first, first)
    layer.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    assert torch.equal(layer.keys[:, :, : kv_cache.INITIAL_CAPACITY], first)
    assert layer._keys.shape[2] == 2 * kv_cache.INITIAL_CAPACITY


def test_only_plain_full_attention_layers_are_replaced() -> None:
    config = LlamaConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
    assert all(type(layer) is GrowableLayer for layer in new_cache(config).layers)
    config.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    config.sliding_window = 8
    kinds = [type(layer) for layer in new_cache(config).layers]
    assert kinds == [GrowableLayer, DynamicSlidingWindowLayer, GrowableLayer]


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


@torch.inference_mode()
def test_grouped_attention_and_growable_cache_give_transformers_logits() -> None:
    """A prefill, a one-token step and a five-token verification pass, each against
    transformers' sdpa attention over its DynamicCache."""
    reference, ours = _model(), _model()
    use_cpu_gqa_attention(ours)
    assert ours.config._attn_implementation == CPU_GQA_SDPA
    ref_cache, our_cache = DynamicCache(config=reference.config), new_cache(ours.config)
    for chunk in ([5, 9, 2, 77, 31, 8], [40], [1, 2, 3, 4, 5]):
        ids = torch.tensor([chunk])
        expected = reference(input_ids=ids, cache=ref_cache).logits
        actual = ours(input_ids=ids, cache=our_cache).logits
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    ref_cache.crop(-3)
    our_cache.crop(-3)
    ids = torch.tensor([[6, 6]])
    torch.testing.assert_close(
        ours(input_ids=ids, cache=our_cache).logits,
        reference(input_ids=ids, cache=ref_cache).logits,
        rtol=1e-5, atol=1e-5,
    )
