"""SDPA attention for CPU passes that attends grouped KV heads in place, and attends in
float32 where PyTorch's half-precision CPU kernel is slow.

Transformers' ``sdpa`` attention copies every cached key and value once per query-head group
(``repeat_kv``) whenever a mask is given, which it always is for a pass of several tokens over
a cache, because CUDA's fused kernels cannot take grouped heads with a mask. PyTorch's CPU
kernel can (``enable_gqa``), so on CPU verification passes skip that copy of the whole cache
in every layer. Everything else is left to transformers' own ``sdpa``.

PyTorch's CPU flash attention in bfloat16 repacks keys and values for its bfloat16 kernel at
every call, so for a single query row it costs several times what the float32 kernel takes
with the casts included (figures: bench/results/2026-12-06-engine-batching-and-kernels.md,
"Where a CPU decode step goes"). So a half-precision pass of at most
``FLOAT32_ATTENTION_ROWS`` rows (decode and verification steps) attends in float32 and rounds
the result back; prefill chunks, where the half-precision kernel amortises its repacking,
attend in the model's dtype. Plain and verification steps thus attend alike, in float32,
whatever their row count. The batched runner's slot cache keeps a half-precision model's keys
and values in float32 (widened exactly), so that cast is a no-op for them, and narrows them
back (exactly) for a prefill chunk.

A shared pass of several sequences gives ``slot_spans`` (``engine.models.batched_cache``): the keys
and values are then the whole arena, ``[1, kv_heads, positions, head_dim]``, and each batch
row attends over a view of its own extent, with its own columns of the mask: what a pass of
that sequence alone computes, without copying the batch's keys and values into a padded
tensor per layer per step.

Every CPU pass of at most ``FLOAT32_ATTENTION_ROWS`` rows attending in float32 (decode and
verification steps, batched or alone) goes to the compiled kernel of
``engine.kernels.decode_attention`` first: one call per layer for the whole batch, each row
computed independently of the rest of its pass (so a decode row is bitwise row 0 of a
verification pass, and a sequence alone bitwise its rows in a batch). Where it does not
apply (no compiler, an additive mask, another layout), the SDPA paths below run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from engine.api.types import MAX_STEP_ROWS
from engine.kernels import decode_attention

CPU_GQA_SDPA = "specgate_cpu_gqa_sdpa"
# Passes of at most this many query rows attend in float32 when the model is in half precision:
# every decode and verification pass (a pass of the longest proposal included).
FLOAT32_ATTENTION_ROWS = MAX_STEP_ROWS
# Keyword arguments that only transformers' own sdpa path handles.
_SPECIAL = ("position_bias", "softcap", "s_aux", "sinks")


def cpu_gqa_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    spans: list[tuple[int, int]] | None = kwargs.pop("slot_spans", None)
    # Each batch row's own rows (the rest padding), which the compiled kernel skips.
    row_counts: list[int] | None = kwargs.pop("row_counts", None)
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    special = any(kwargs.get(name) is not None for name in _SPECIAL)
    if special or query.device.type != "cpu" or module.training:
        if spans is not None:
            raise ValueError("per-sequence key spans need engine.models.attention's CPU path")
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    dtype = compute = query.dtype
    if dtype in (torch.bfloat16, torch.float16) and query.shape[2] <= FLOAT32_ATTENTION_ROWS:
        compute = torch.float32
        query = query.float()
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
    if spans is not None and attention_mask is None and query.shape[2] > 1:
        raise ValueError("per-sequence attention of several rows needs the pass's mask")
    if compute == torch.float32 and query.shape[2] <= FLOAT32_ATTENTION_ROWS:
        if spans is None:  # (a cache in float32 under a half-precision model: no copy)
            key, value = key.to(compute), value.to(compute)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        attended = decode_attention.attend(
            query, key, value, attention_mask, spans, scale, row_counts
        )
        if attended is not None:
            return attended.to(dtype), None
    if spans is not None:
        out = _attend_each_sequence(query, key, value, attention_mask, spans, scaling)
        return out.transpose(1, 2).contiguous().to(dtype), None
    # A cache kept in float32 under a half-precision model holds the model's values exactly.
    key, value = key.to(compute), value.to(compute)
    if not grouped:
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out.to(dtype), None
    causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, is_causal=causal,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous().to(dtype), None


def _attend_each_sequence(
    query: torch.Tensor,
    arena_keys: torch.Tensor,
    arena_values: torch.Tensor,
    mask: torch.Tensor | None,
    spans: list[tuple[int, int]],
    scaling: float | None,
) -> torch.Tensor:
    """Attention of batch row ``b`` over positions ``[offset, offset + length)`` of the
    arenas (``[1, kv_heads, positions, head_dim]``, ``spans[b]``), with the first ``length``
    columns of its mask (None: one query row per sequence, seeing all of its extent), in the
    query's dtype: the same computation as a pass of that sequence alone, without a padded
    copy of every sequence's keys and values."""
    outs = []
    for b, (offset, length) in enumerate(spans):
        keys = arena_keys[:, :, offset : offset + length].to(query.dtype)
        values = arena_values[:, :, offset : offset + length].to(query.dtype)
        row_mask = None if mask is None else mask[b : b + 1, :, :, :length]
        outs.append(F.scaled_dot_product_attention(
            query[b : b + 1], keys, values, attn_mask=row_mask, scale=scaling, enable_gqa=True,
        ))
    return torch.cat(outs)


AttentionInterface.register(CPU_GQA_SDPA, cpu_gqa_sdpa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(CPU_GQA_SDPA, sdpa_mask)


def use_cpu_gqa_attention(model: PreTrainedModel) -> None:
    """Switch a CPU model that uses ``sdpa`` to the in-place grouped variant."""
    if model.device.type == "cpu" and model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(CPU_GQA_SDPA)
