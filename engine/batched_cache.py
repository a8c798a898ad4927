"""A KV cache for many sequences at once: one padded buffer per layer, one slot per sequence.

Each full-attention layer keeps ``[slots, kv_heads, capacity, head_dim]`` keys and values
(capacity doubled when a pass needs more). Before a pass the runner says which slots take
part and at which storage index each fed row lands (``SlotBatch``); the layer writes the
new keys there (one slice copy when the whole batch writes one run, a scatter otherwise)
and hands attention a view of the participating slots' first ``kv_length`` positions.
Which of those positions a row may see is the attention mask's business, so a
sequence's length is only a number in the runner: rollback is O(1) (lower the number), and
keeping a tree's accepted path copies only the accepted entries (``keep_path``).

Why padded slots and not pages: on CPU, PyTorch's SDPA reads one contiguous key/value
tensor per sequence; a paged cache would have to gather its pages into one in every layer
of every pass, a copy of the whole live cache per step, which is what the growable cache
was written to avoid. The price of padding is memory (every slot has the capacity of the
longest) and attention over the longest slot's length with the rest masked; both are small
beside the weights at the batch sizes two cores can serve. A paged cache pays where memory,
not bandwidth, bounds the batch (accelerators with a paged-attention kernel).

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
    """The slots of one pass: rows ``b`` of the batch use slot ``slots[b]``, fed row ``t``
    is stored at index ``write_index[b, t]``, and attention sees ``kv_length`` positions."""

    slots: list[int]
    write_index: torch.Tensor  # [batch, rows] long
    kv_length: int
    # Where each row's fed rows start when every row writes one run of indices (the runner's
    # passes always do): a slice copy, several times cheaper than a scatter for one row.
    starts: list[int] | None = None

    def single_run(self) -> tuple[int, int] | None:
        """(start, rows) when the whole batch writes one run at one start: a slice copy."""
        if self.starts is None or any(start != self.starts[0] for start in self.starts):
            return None
        return self.starts[0], int(self.write_index.shape[1])

    def contiguous_range(self) -> tuple[int, int] | None:
        first = self.slots[0]
        if self.slots == list(range(first, first + len(self.slots))):
            return first, first + len(self.slots)
        return None


class SlotLayer(DynamicLayer):
    """One attention layer's keys and values for every slot of a ``SlotCache``."""

    def __init__(self, cache: SlotCache) -> None:
        super().__init__()
        self.owner = cache
        self._keys = torch.empty(0)
        self._values = torch.empty(0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        capacity = max(INITIAL_CAPACITY, self.owner.batch.kv_length)
        self._keys = self._allocate(key_states, capacity)
        self._values = self._allocate(value_states, capacity)
        self.is_initialized = True

    def _allocate(self, like: torch.Tensor, capacity: int) -> torch.Tensor:
        _, heads, _, dim = like.shape
        return like.new_zeros((self.owner.max_slots, heads, capacity, dim))

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self._keys.shape[2])
        keys = self._allocate(self._keys, capacity)
        values = self._allocate(self._values, capacity)
        old = self._keys.shape[2]
        keys[:, :, :old] = self._keys
        values[:, :, :old] = self._values
        self._keys, self._values = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.owner.batch
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        needed = max(batch.kv_length, int(batch.write_index.max()) + 1)
        if needed > self._keys.shape[2]:
            self._grow(needed)
        span = batch.contiguous_range()
        length = batch.kv_length
        run = batch.single_run()
        if span is not None and run is not None:
            lo, hi = span
            start, rows = run
            self._keys[lo:hi, :, start : start + rows] = key_states
            self._values[lo:hi, :, start : start + rows] = value_states
            self.keys, self.values = self._keys[lo:hi, :, :length], self._values[lo:hi, :, :length]
            return self.keys, self.values
        if span is not None:
            lo, hi = span
            keys, values = self._keys[lo:hi], self._values[lo:hi]
            index = batch.write_index[:, None, :, None].expand_as(key_states)
            keys.scatter_(2, index, key_states)
            values.scatter_(2, index, value_states)
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]
            return self.keys, self.values
        slots = torch.tensor(batch.slots, device=self._keys.device)
        heads = torch.arange(key_states.shape[1], device=self._keys.device)
        where = (slots[:, None, None], heads[None, :, None], batch.write_index[:, None, :])
        self._keys.index_put_(where, key_states)
        self._values.index_put_(where, value_states)
        self.keys = self._keys[slots, :, :length]
        self.values = self._values[slots, :, :length]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.owner.batch.kv_length if self.is_initialized else 0

    def move(self, slot: int, source: list[int], target: list[int]) -> None:
        """Within ``slot``, copy the entries at ``source`` indices to ``target`` indices."""
        if not self.is_initialized or not source:
            return
        src = torch.tensor(source, device=self._keys.device)
        dst = torch.tensor(target, device=self._keys.device)
        for buffer in (self._keys, self._values):
            buffer[slot, :, dst] = buffer[slot, :, src]

    def copy_slot(self, source: int, target: int, length: int) -> None:
        if self.is_initialized and length:
            self._keys[target, :, :length] = self._keys[source, :, :length]
            self._values[target, :, :length] = self._values[source, :, :length]

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self._keys = self._values = torch.empty(0)


class SlotCache(DynamicCache):
    """transformers' cache interface over ``SlotLayer``s; ``batch`` is set before each pass."""

    def __init__(self, config: PretrainedConfig, max_slots: int) -> None:
        super().__init__(config=config)
        if not supports_batching(config):
            raise ValueError("the model has layers the slot cache cannot batch")
        self.max_slots = max_slots
        self.batch = SlotBatch([0], torch.zeros((1, 1), dtype=torch.long), 0)
        count = len(self.layers) or config.num_hidden_layers
        self.layers = [SlotLayer(self) for _ in range(count)]
        self.layer_class_to_replicate = None

    @property
    def slot_layers(self) -> list[SlotLayer]:
        return [layer for layer in self.layers if isinstance(layer, SlotLayer)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.batch.kv_length

    def move(self, slot: int, source: list[int], target: list[int]) -> None:
        for layer in self.slot_layers:
            layer.move(slot, source, target)

    def copy_slot(self, source: int, target: int, length: int) -> None:
        for layer in self.slot_layers:
            layer.copy_slot(source, target, length)
