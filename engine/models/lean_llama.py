"""A lean forward for Llama-shaped causal LMs on the CPU: HF's arithmetic, fewer calls.

A decode step of SmolLM2-135M runs about 1,500 PyTorch operators, most of them on tensors of
a few hundred elements, and HF's modules add their Python around each (keyword plumbing,
mask construction, output records, hooks): on a small CPU the pass is bound by calls as
much as by bytes. ``LeanLlama`` runs the same computation, operator for operator where it
matters for the bits, with less around it:

- one Python function per pass over plain tuples of each layer's parameters (no module
  calls, no ``**kwargs``, no ``create_causal_mask``: the runner's mask goes straight to
  attention);
- RMSNorm as ``torch.rms_norm`` in float32 (HF's ``pow``/``mean``/``rsqrt``/``mul``, one
  kernel), then HF's cast and weight product;
- rotary embedding on the queries and keys at once (they are adjacent columns of the fused
  q/k/v product: one ``mul``/``cat``/``mul``/``add`` instead of two), HF's formula;
- the SiLU gate and its product in place on the fused gate/up product;
- the LM head over the rows whose logits are wanted only (no padding rows; with
  ``last_only`` the last row).

Element-wise results are those of HF's forward over the same fused products
(``engine.models.fused_projections``): the same operators in the same dtypes, in the same order
(``tests/engine/test_engine_lean_llama.py`` checks logits and hidden states bitwise against HF's
modules over the same fused model in float32 and bfloat16, and within 1e-4 in float32
against the unfused model, over ragged batches, trees and padding; the demo target gave
bitwise HF's logits too). Only exact ``LlamaForCausalLM`` models whose every layer is
HF's own Llama decoder layer, fused by ``engine.models.packed_linear.pack_linear_weights``, with
SiLU, the CPU attention of ``engine.models.attention`` and no hooks, take it (``lean_model``);
everything else keeps HF's modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaRMSNorm,
)

from engine.models.attention import CPU_GQA_SDPA, cpu_gqa_sdpa_forward
from engine.models.batched_cache import SlotCache
from engine.models.fused_projections import FusedPackedLinear


@dataclass(frozen=True)
class _Layer:
    attention: LlamaAttention  # for engine.models.attention's function (heads, scaling)
    input_norm: torch.Tensor
    qkv: FusedPackedLinear
    o_proj: torch.nn.Module
    post_norm: torch.Tensor
    gate_up: FusedPackedLinear
    down_proj: torch.nn.Module


def _hooked(module: torch.nn.Module) -> bool:
    return any(
        getattr(m, name)
        for m in module.modules()
        for name in ("_forward_hooks", "_forward_pre_hooks")
    )


def lean_model(model: PreTrainedModel) -> LeanLlama | None:
    """A ``LeanLlama`` over ``model`` where its forward is exactly what the lean one computes,
    None otherwise (the caller runs HF's forward)."""
    config = model.config
    if type(model) is not LlamaForCausalLM or type(model.model) is not LlamaModel:
        return None
    if config._attn_implementation != CPU_GQA_SDPA or config.hidden_act != "silu":
        return None
    if type(model.model.norm) is not LlamaRMSNorm or model.training:
        return None
    for layer in model.model.layers:
        if type(layer) is not LlamaDecoderLayer:
            return None
        if type(layer.self_attn) is not LlamaAttention or type(layer.mlp) is not LlamaMLP:
            return None
        if not (hasattr(layer.self_attn, "fused_qkv") and hasattr(layer.mlp, "fused_gate_up")):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(norm) is not LlamaRMSNorm for norm in norms):
            return None
    if _hooked(model):
        return None
    return LeanLlama(model)


class LeanLlama:
    """The forward of a fused Llama model (``lean_model`` says which), over a
    ``engine.models.batched_cache.SlotCache``."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        config = model.config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = self.heads // int(model.model.layers[0].self_attn.num_key_value_groups)
        self.head_dim = int(model.model.layers[0].self_attn.head_dim)
        self.eps = float(config.rms_norm_eps)
        self.layers = tuple(
            _Layer(
                attention=layer.self_attn,
                input_norm=layer.input_layernorm.weight,
                qkv=layer.self_attn.fused_qkv,
                o_proj=layer.self_attn.o_proj,
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=layer.mlp.fused_gate_up,
                down_proj=layer.mlp.down_proj,
            )
            for layer in model.model.layers[: config.num_hidden_layers]
        )
        if any(norm.variance_epsilon != self.eps for norm in self._norms()):
            raise ValueError("the lean forward takes one RMSNorm epsilon for the model")

    def unhooked(self) -> bool:
        """Whether the model still has no hook of its own: one registered since it was checked
        (a perturbation in a test, a profiler) runs HF's forward, which calls it."""
        return not (self.model._forward_hooks or self.model._forward_pre_hooks)

    def _norms(self) -> list[LlamaRMSNorm]:
        inner = self.model.model
        layers = inner.layers[: self.model.config.num_hidden_layers]
        return [inner.norm] + [
            norm for layer in layers
            for norm in (layer.input_layernorm, layer.post_attention_layernorm)
        ]

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        normed = torch.rms_norm(hidden.float(), (hidden.shape[-1],), eps=self.eps)
        return weight * normed.to(hidden.dtype)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: SlotCache,
        spans: list[tuple[int, int]] | None,
        rows: torch.Tensor | None,
        sizes: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (model dtype) and the LM head's input of the pass ``ids`` ``[batch, rows]``
        at ``positions`` with ``mask`` (as the attention function takes it; None: every row sees
        the whole cache its sequence has, which only one row per sequence may), storing keys and
        values in ``cache``.

        ``sizes``: each sequence's own rows, the first ``sizes[b]`` of its ``rows`` (None: all
        are its own). Only attention's layout is padded, and the compiled attention skips the
        padding rows; everything else runs on the sequences' own rows alone, so a step where
        one sequence verifies a long proposal costs its rows, not every sequence padded to
        them (each row is computed on its own, so the results of the others do not change).
        ``rows``: indices into the own rows, in order, of those whose logits are wanted (None:
        all), both outputs ``[len(rows), ...]`` then."""
        inner = self.model.model
        batch, width = ids.shape
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        padded = batch * width
        hidden = inner.embed_tokens(ids).reshape(padded, -1)
        cos, sin = inner.rotary_emb(hidden, position_ids=positions)
        cos = cos.reshape(batch, width, 1, dim)
        sin = sin.reshape(batch, width, 1, dim)
        real = laid_out = None  # the own rows' indices; attention's layout of q/k/v
        if sizes is not None and sum(sizes) < padded:
            real = torch.tensor(
                [b * width + r for b, n in enumerate(sizes) for r in range(n)],
                device=hidden.device,
            )
            hidden = hidden.index_select(0, real)
            laid_out = hidden.new_zeros((padded, (heads + 2 * kv_heads) * dim))
        half = dim // 2
        rope_width = (heads + kv_heads) * dim
        stores = cache.slot_layers
        for index, layer in enumerate(self.layers):
            normed = self._norm(hidden, layer.input_norm)
            qkv = layer.qkv.product(normed)
            if laid_out is not None:
                # One buffer for every layer: the store copies keys and values into the
                # cache, and nothing reads this layer's q/k/v after its attention.
                qkv = laid_out.index_copy_(0, real, qkv)
            qkv = qkv.view(batch, width, -1)
            qk = qkv[..., :rope_width].view(batch, width, heads + kv_heads, dim)
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + rotated * sin
            query = qk[:, :, :heads].transpose(1, 2)
            key = qk[:, :, heads:].transpose(1, 2)
            value = qkv[..., rope_width:].view(batch, width, kv_heads, dim).transpose(1, 2)
            key, value = stores[index].update(key, value)
            attended, _ = cpu_gqa_sdpa_forward(
                layer.attention, query, key, value, mask,
                scaling=layer.attention.scaling, slot_spans=spans,
                row_counts=None if real is None else sizes,
            )
            attended = attended.reshape(padded, -1)
            if real is not None:
                attended = attended.index_select(0, real)
            hidden = hidden + layer.o_proj(attended)
            normed = self._norm(hidden, layer.post_norm)
            gate_up = layer.gate_up.product(normed)
            gate, up = gate_up.split(layer.gate_up.sizes, dim=-1)
            hidden = hidden + layer.down_proj(F.silu(gate) * up)
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        hidden = self._norm(hidden, inner.norm.weight)
        return self.model.lm_head(hidden), hidden
