"""The fused q/k/v and gate/up products (``engine.models.fused_projections``) compute HF's forward.

On tiny Llama models, a packed and fused model's logits equal HF's own forward within the
dtype's rounding, and its greedy tokens are HF's: a full forward, and batched passes with
ragged cached lengths, padding rows and proposal trees; a pass recording autograd trains
through the original parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

from engine.models.batched_runner import BatchedRunner, Feed
from engine.models.fused_projections import FusedPackedLinear
from engine.models.loading import load_model
from engine.models.packed_linear import PackedLinear, pack_linear_weights
from tests.tiny_models import build_three_layer_target, load_packed

CPU = torch.device("cpu")
# Logit tolerance: float32 sums in another order; bfloat16 rounds every layer's output.
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_three_layer_target(tmp_path_factory, "fused", seed=3)


def test_every_llama_attention_and_mlp_runs_one_fused_product(target: Path) -> None:
    model = load_packed(target, "float32")
    attentions = [m for m in model.modules() if type(m) is LlamaAttention]
    mlps = [m for m in model.modules() if type(m) is LlamaMLP]
    assert attentions and mlps
    for module in attentions:
        assert isinstance(module.fused_qkv, FusedPackedLinear)
        assert module.fused_qkv.sizes == [
            module.q_proj.out_features, module.k_proj.out_features, module.v_proj.out_features
        ]
        # The members run through the fused product only: no packed copy of their own.
        assert all(type(p) is torch.nn.Linear for p in (module.q_proj, module.k_proj))
        assert isinstance(module.o_proj, PackedLinear)
    for mlp in mlps:
        assert isinstance(mlp.fused_gate_up, FusedPackedLinear)
        assert isinstance(mlp.down_proj, PackedLinear)
    before = sum(1 for _ in model.modules())
    pack_linear_weights(model)  # idempotent
    assert sum(1 for _ in model.modules()) == before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_forward_gives_hf_logits_and_greedy_tokens(target: Path, dtype: str) -> None:
    model = load_packed(target, dtype)
    reference = load_model(target, CPU, dtype)  # type: ignore[arg-type]
    torch.manual_seed(0)
    ids = torch.randint(3, 300, (3, 17))
    with torch.inference_mode():
        got = model(input_ids=ids).logits.float()
        expected = reference(input_ids=ids).logits.float()
    assert (got - expected).abs().max().item() <= TOLERANCE[dtype]
    if dtype == "float32":
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_batched_passes_with_ragged_lengths_padding_and_trees_match_hf(target: Path) -> None:
    fused = BatchedRunner(load_packed(target, "float32"), max_slots=3)
    plain = BatchedRunner(load_model(target, CPU, "float32"), max_slots=3)
    prompts = [list(range(5, 5 + n)) for n in (9, 23, 4)]
    feeds = [
        [Feed(slot, prompt) for slot, prompt in enumerate(prompts)],  # ragged prefill, padded
        [
            Feed(0, [40]),  # a decode row beside a tree and a chain
            Feed(1, [41, 50, 51, 52, 53], parents=(-1, -1, 0, 0)),
            Feed(2, [42, 60, 61]),
        ],
    ]
    for pass_feeds in feeds:
        got = fused.forward(pass_feeds)
        expected = plain.forward(pass_feeds)
        for a, b in zip(got, expected, strict=True):
            assert a.shape == b.shape
            assert (a - b).abs().max().item() <= TOLERANCE["float32"]
            assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_a_pass_recording_autograd_trains_the_original_parameters(target: Path) -> None:
    model = load_packed(target, "float32")
    assert isinstance(model, LlamaForCausalLM)
    model.train()
    ids = torch.randint(3, 300, (2, 7))
    model(input_ids=ids, labels=ids).loss.backward()
    attention = model.model.layers[0].self_attn
    mlp = model.model.layers[0].mlp
    for linear in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj):
        assert linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0
