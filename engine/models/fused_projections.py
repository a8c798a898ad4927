"""Llama-family attention and MLP forwards that run their input projections as one product.

A decode pass on CPU is overhead-bound in its small matrix products: on SmolLM2-135M a oneDNN
call costs about 90 us whether its weight is 192 or 576 rows (k/v and q projections alike),
so the seven products per layer cost more in calls than in bytes. q, k and v read the same
input, and so do gate and up; each group is packed once as one weight (its rows stacked, the
layout vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear`` use), and a pass runs
two products where HF's forwards run five. The rest of each forward is HF's own, in the same
order (rotary, the cache's ``update``, the configured attention, ``o_proj``; SiLU-gated MLP).

Every output element is still one dot product over the same input row, but oneDNN blocks a
wider product differently, so the sums may round otherwise than the separate products' (in
bfloat16 by a fraction of a logit, enough to flip a near-tie); the
engine's plain and speculative passes all run the fused model, so they agree with each
other as before. Only modules of exactly
``LlamaAttention`` and ``LlamaMLP`` are fused (other architectures keep HF's forwards), and a
pass recording autograd runs HF's forward over the original parameters.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    LlamaAttention,
    LlamaMLP,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from engine.kernels import small_gemm


class FusedPackedLinear(torch.nn.Module):
    """Several linear layers over one input as one oneDNN-packed product; ``forward`` returns
    each layer's output (views of the product, in the layers' order)."""

    packed_weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linears: list[torch.nn.Linear]) -> None:
        super().__init__()
        self.sizes = [linear.out_features for linear in linears]
        # float32 where the small-product kernel is built: its panels for short passes, and
        # for long ones (prefill) F.linear on the layers' own weights, side by side.
        self.small = small_gemm.applies(linears[0].weight)
        self.linears = tuple(linears)  # not submodules: the model holds them already
        with torch.no_grad():
            weight = torch.cat([linear.weight.detach() for linear in linears])
            biases = [linear.bias for linear in linears]
            bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
            packed = (small_gemm.pack(weight) if self.small
                      else torch.ops.mkldnn._reorder_linear_weight(weight))
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def product(self, input: torch.Tensor) -> torch.Tensor:
        """The layers' outputs side by side, ``[..., sum(sizes)]``."""
        weight, bias = self.packed_weight, self.bias
        if not self.small:
            return torch.ops.mkldnn._linear_pointwise(input, weight, bias, "none", [], "")
        out = small_gemm.product(input, weight, sum(self.sizes), bias)
        if out is not None:
            return out
        return torch.cat([
            F.linear(input, linear.weight.detach(),
                     None if linear.bias is None else linear.bias.detach())
            for linear in self.linears
        ], dim=-1)

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.product(input).split(self.sizes, dim=-1))


def _fused(module: torch.nn.Module, name: str) -> FusedPackedLinear:
    fused = getattr(module, name)
    assert isinstance(fused, FusedPackedLinear)
    return fused


def _recording(hidden_states: torch.Tensor, module: torch.nn.Module) -> bool:
    return torch.is_grad_enabled() and (
        hidden_states.requires_grad or any(p.requires_grad for p in module.parameters())
    )


def _attention_forward(
    self: LlamaAttention,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if _recording(hidden_states, self):
        return LlamaAttention.forward(
            self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs
        )
    assert position_embeddings is not None
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query, key, value = _fused(self, "fused_qkv")(hidden_states)
    query_states = query.view(hidden_shape).transpose(1, 2)
    key_states = key.view(hidden_shape).transpose(1, 2)
    value_states = value.view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    if cache is not None:
        key_states, value_states = cache.update(
            key_states, value_states, self.layer_idx, kwargs=kwargs
        )
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )
    out, weights = attention(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0, scaling=self.scaling, **kwargs,
    )
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _mlp_forward(self: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
    if _recording(x, self):
        return LlamaMLP.forward(self, x)
    gate, up = _fused(self, "fused_gate_up")(x)
    return self.down_proj(self.act_fn(gate) * up)


_GROUPS: dict[type, tuple[str, tuple[str, ...], Any]] = {
    LlamaAttention: ("fused_qkv", ("q_proj", "k_proj", "v_proj"), _attention_forward),
    LlamaMLP: ("fused_gate_up", ("gate_proj", "up_proj"), _mlp_forward),
}


def fuse_projections(
    model: torch.nn.Module, packable: Callable[[torch.nn.Linear], bool]
) -> list[torch.nn.Linear]:
    """Give every ``LlamaAttention`` and ``LlamaMLP`` of ``model`` whose input projections
    ``packable`` accepts a fused product and the forward that runs it. Returns the linears
    whose inference passes a fused product now runs (those fused before included), which
    need no packed copy of their own. Idempotent."""
    replaced: list[torch.nn.Linear] = []
    for module in model.modules():
        if type(module) not in _GROUPS:
            continue
        name, members, forward = _GROUPS[type(module)]
        group = [getattr(module, member) for member in members]
        if not hasattr(module, name):
            if not all(type(linear) is torch.nn.Linear and packable(linear) for linear in group):
                continue
            module.add_module(name, FusedPackedLinear(group))
            module.forward = types.MethodType(forward, module)
        replaced += group
    return replaced
