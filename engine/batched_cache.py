"""A KV cache for many sequences at once: one slot per sequence, each slot growing on its own.

Each full-attention layer keeps, per slot, ``[kv_heads, capacity, head_dim]`` keys and values.
A slot's capacity grows by doubling up to what the slot was reserved (``reserve``: the
request's prompt + max_tokens + one step's rows), so a short request beside a long prompt
keeps a short buffer, and a released slot gives its memory back. Before a pass the runner
says which slots take part, where each one's fed rows start and how many rows every
sequence feeds (``SlotBatch``); the layer writes the new keys behind each slot's prefix (one
slice copy per slot) and hands attention ``[batch, kv_heads, kv_length, head_dim]``.
Which of those positions a row may see is the attention mask's business, so a sequence's
length is only a number in the runner: rollback is O(1) (lower the number), keeping a tree's
accepted path copies only the accepted entries (``move``), and moving a sequence to another
slot moves a reference (``move_slot``).

What attention reads: a pass of one sequence gets a view of its own buffer (no copy); a pass
of several gets their prefixes gathered into one transient padded tensor per layer (PyTorch's
CPU SDPA takes one ``[batch, ...]`` tensor), freed when the layer is done. That gather is
what per-slot growth costs against one buffer padded over every slot (the layout before
this one, where one 2,000-token prompt made every slot 2,048 positions long for as long as
it ran): a copy of the batch's live keys and values per layer per step, small beside the
weights a pass reads at the batch sizes two cores serve (``bench.batch_memory`` measures
both). A paged cache would gather the same way, from pages instead of slots.

Only layers of plain full attention are batched; a model with sliding-window, chunked or
recurrent layers is served one sequence at a time (``supports_batching``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

INITIAL_CAPACITY = 256


def supports_batching(config: PretrainedConfig) -> bool:
    """Whether every cache layer of the model is plain full attention (slot-batchable)."""
    cache = DynamicCache(config=config)
    if not cache.layers:
        return cache.layer_class_to_replicate is DynamicLayer
    return all(type(layer) is DynamicLayer for layer in cache.layers)


@dataclass
class SlotBatch:
    """The slots of one pass: batch row ``b`` uses slot ``slots[b]``, its ``rows`` fed rows
    (padding included) are stored from index ``starts[b]``, and attention sees ``kv_length``
    positions (the longest prefix plus the rows)."""

    slots: list[int]
    starts: list[int]
    rows: int
    kv_length: int


class SlotLayer(DynamicLayer):
    """One attention layer's keys and values, a pair of buffers per slot of a ``SlotCache``."""

    def __init__(self, cache: SlotCache) -> None:
        super().__init__()
        self.owner = cache
        self._keys: list[torch.Tensor | None] = [None] * cache.max_slots
        self._values: list[torch.Tensor | None] = [None] * cache.max_slots

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def capacity(self, slot: int) -> int:
        keys = self._keys[slot]
        return 0 if keys is None else int(keys.shape[1])

    def _ensure(
        self, slot: int, needed: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's buffers, grown to hold ``needed`` positions: doubling, but not past the
        slot's reservation unless a pass needs more."""
        keys, values = self._keys[slot], self._values[slot]
        if keys is not None and values is not None and needed <= keys.shape[1]:
            return keys, values
        limit = self.owner.reserved[slot] or None
        old = 0 if keys is None else int(keys.shape[1])
        grown = max(INITIAL_CAPACITY, 2 * old)
        capacity = max(needed, grown if limit is None else min(grown, limit))
        heads, dim = like.shape[1], like.shape[3]
        # Zeros, not empty: attention multiplies masked positions' values by 0, and an
        # uninitialised NaN would survive that.
        new_keys = like.new_zeros((heads, capacity, dim))
        new_values = like.new_zeros((heads, capacity, dim))
        if keys is not None and values is not None:
            new_keys[:, :old] = keys
            new_values[:, :old] = values
        self._keys[slot], self._values[slot] = new_keys, new_values
        return new_keys, new_values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.owner.batch
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, length = batch.rows, batch.kv_length
        stored: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for b, (slot, start) in enumerate(zip(batch.slots, batch.starts, strict=True)):
            keys, values = self._ensure(slot, start + rows, key_states)
            keys[:, start : start + rows] = key_states[b]
            values[:, start : start + rows] = value_states[b]
            stored.append((keys, values, start + rows))
        if len(stored) == 1:
            keys, values, end = stored[0]
            return keys[None, :, :end], values[None, :, :end]
        # Not kept on the layer (DynamicLayer's keys/values): a padded copy per layer would
        # outlive the pass, which is the memory per-slot growth saves.
        shape = (len(stored), key_states.shape[1], length, key_states.shape[3])
        gathered_keys, gathered_values = key_states.new_empty(shape), value_states.new_empty(shape)
        for b, (keys, values, end) in enumerate(stored):
            gathered_keys[b, :, :end] = keys[:, :end]
            gathered_values[b, :, :end] = values[:, :end]
            if end < length:  # never attended, but must be finite (see ``_ensure``)
                gathered_keys[b, :, end:] = 0
                gathered_values[b, :, end:] = 0
        return gathered_keys, gathered_values

    def get_seq_length(self) -> int:
        return self.owner.batch.kv_length if self.is_initialized else 0

    def move(self, slot: int, source: list[int], target: list[int]) -> None:
        """Within ``slot``, copy the entries at ``source`` indices to ``target`` indices."""
        keys, values = self._keys[slot], self._values[slot]
        if keys is None or values is None or not source:
            return
        src = torch.tensor(source, device=keys.device)
        dst = torch.tensor(target, device=keys.device)
        for buffer in (keys, values):
            buffer[:, dst] = buffer[:, src]

    def move_slot(self, source: int, target: int) -> None:
        self._keys[target], self._values[target] = self._keys[source], self._values[source]
        self._keys[source] = self._values[source] = None

    def release(self, slot: int) -> None:
        self._keys[slot] = self._values[slot] = None

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self._keys = [None] * self.owner.max_slots
        self._values = [None] * self.owner.max_slots


class SlotCache(DynamicCache):
    """transformers' cache interface over ``SlotLayer``s; ``batch`` is set before each pass."""

    def __init__(self, config: PretrainedConfig, max_slots: int) -> None:
        super().__init__(config=config)
        if not supports_batching(config):
            raise ValueError("the model has layers the slot cache cannot batch")
        self.max_slots = max_slots
        # Per slot, the most positions its buffers grow to by doubling (0: no bound).
        self.reserved = [0] * max_slots
        self.batch = SlotBatch([0], [0], 1, 0)
        count = len(self.layers) or config.num_hidden_layers
        self.layers = [SlotLayer(self) for _ in range(count)]
        self.layer_class_to_replicate = None

    @property
    def slot_layers(self) -> list[SlotLayer]:
        return [layer for layer in self.layers if isinstance(layer, SlotLayer)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.batch.kv_length

    def allocated_positions(self) -> int:
        """Positions allocated over every slot (per layer; keys and values alike)."""
        layers = self.slot_layers
        return sum(layers[0].capacity(slot) for slot in range(self.max_slots)) if layers else 0

    def reserve(self, slot: int, positions: int) -> None:
        """Bound the slot's growth to ``positions`` (a pass that needs more still gets it)."""
        self.reserved[slot] = positions

    def move(self, slot: int, source: list[int], target: list[int]) -> None:
        for layer in self.slot_layers:
            layer.move(slot, source, target)

    def move_slot(self, source: int, target: int) -> None:
        for layer in self.slot_layers:
            layer.move_slot(source, target)
        self.reserved[target], self.reserved[source] = self.reserved[source], 0

    def release(self, slot: int) -> None:
        """Free the slot's buffers and its reservation."""
        for layer in self.slot_layers:
            layer.release(slot)
        self.reserved[slot] = 0
