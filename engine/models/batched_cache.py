"""A KV cache for many sequences at once: one arena per layer, one extent of it per sequence.

Each full-attention layer keeps its keys and values in an arena, ``[kv_heads, positions,
head_dim]``; every slot (one running sequence) owns one contiguous extent of it, the same
offsets in every layer (``SlotCache`` keeps them). An extent grows on its own, by doubling
up to what the slot was reserved (``reserve``: the request's prompt + max_tokens + one
step's rows), into free space of the arena; a released slot's extent is free again, and when
no free run is long enough the live extents are packed to the front first. So a short
request beside a long prompt keeps a short extent, and the arena holds the sum of the
running sequences' extents, not slots x the longest (the layout before this one kept one
buffer over every slot, as long as the longest: one 2,000-token prompt made all 16 slots
2,048 positions long while it ran).

A pass (``prepare``, then the model) writes every fed row with one ``index_copy_`` per
layer and tensor; attention gets, for one sequence, a view of its extent (no copy). For
several, with ``per_sequence`` (the CPU attention of ``engine.models.attention``, which attends each
sequence over a view of its own extent, ``SlotBatch.spans``), the whole arena, no copy;
otherwise the batch's prefixes gathered with one ``index_select`` into a transient padded
``[batch, kv_heads, kv_length, head_dim]`` tensor, a copy of the batch's live keys and values
per layer per step. ``arena_dtype`` float32 under a half-precision model stores the keys and
values widened (exactly) to the dtype the CPU attention computes decode rows in, so neither
a gather nor a cast copies them per step; it doubles the arena's bytes. Which
positions a row may see is the attention mask's business, so a sequence's length is only a
number in the runner: rollback is O(1) (lower the number), keeping a tree's accepted path
copies only the accepted entries (``move``), and moving a sequence to another slot moves
its extent's offset (``move_slot``).

Only layers of plain full attention are batched; a model with sliding-window, chunked or
recurrent layers is served one sequence at a time (``supports_batching``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    (padding included) are stored from index ``starts[b]`` of its extent, and attention sees
    ``kv_length`` positions (the longest prefix plus the rows)."""

    slots: list[int]
    starts: list[int]
    rows: int
    kv_length: int
    # Set by ``SlotCache.prepare``: arena positions of every fed row, ``[batch * rows]``, and
    # of every position attention reads, ``[batch * kv_length]`` (past a sequence's own end,
    # its last position again: masked, but finite).
    write_index: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    read_index: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    # Set by ``prepare`` for a shared pass of a ``per_sequence`` cache: per batch row, (arena
    # offset, positions attention reads), its own prefix and rows.
    spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class Relocation:
    """Arena positions ``[source, source + length)`` copied to ``[target, target + length)``."""

    source: int
    target: int
    length: int


class SlotLayer(DynamicLayer):
    """One attention layer's arena of keys and values, laid out by its ``SlotCache``."""

    def __init__(self, cache: SlotCache) -> None:
        super().__init__()
        self.owner = cache
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def _arenas(self, key_states: torch.Tensor, value_states: torch.Tensor) -> list[torch.Tensor]:
        """The arenas at the cache's size, with this pass's relocations applied."""
        size = self.owner.positions
        arenas = []
        for arena, like in ((self._keys, key_states), (self._values, value_states)):
            if arena is None or arena.shape[1] < size:
                # Zeros: attention multiplies masked positions' values by 0, and an
                # uninitialised NaN would survive that.
                shape = (like.shape[1], size, like.shape[3])
                grown = like.new_zeros(shape, dtype=self.owner.arena_dtype or like.dtype)
                if arena is not None:
                    grown[:, : arena.shape[1]] = arena
                arena = grown
            for move in self.owner.relocations:
                part = arena[:, move.source : move.source + move.length].clone()
                arena[:, move.target : move.target + move.length] = part
            arenas.append(arena)
        self._keys, self._values = arenas
        return arenas

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch = self.owner.batch
        size, rows, length = len(batch.slots), batch.rows, batch.kv_length
        out = []
        arenas = self._arenas(key_states, value_states)
        for arena, states in zip(arenas, (key_states, value_states), strict=True):
            heads, dim = states.shape[1], states.shape[3]
            fed = states.transpose(0, 1).reshape(heads, size * rows, dim)
            arena.index_copy_(1, batch.write_index, fed.to(arena.dtype))
            if size == 1:
                offset = self.owner.offset(batch.slots[0])
                out.append(arena[None, :, offset : offset + length])
            elif self.owner.per_sequence:
                out.append(arena[None])
            else:
                gathered = arena.index_select(1, batch.read_index)
                out.append(gathered.view(heads, size, length, dim).transpose(0, 1))
        return out[0], out[1]

    def get_seq_length(self) -> int:
        return self.owner.batch.kv_length if self.is_initialized else 0

    def move(self, source: list[int], target: list[int]) -> None:
        """Copy the entries at arena positions ``source`` to positions ``target``."""
        if self._keys is None or self._values is None or not source:
            return
        src = torch.tensor(source, device=self._keys.device)
        dst = torch.tensor(target, device=self._keys.device)
        for arena in (self._keys, self._values):
            arena[:, dst] = arena[:, src]

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self._keys = self._values = None


class SlotCache(DynamicCache):
    """transformers' cache interface over ``SlotLayer``s, and the extents of their arenas;
    ``prepare`` sets the batch before each pass."""

    def __init__(
        self,
        config: PretrainedConfig,
        max_slots: int,
        arena_dtype: torch.dtype | None = None,
        per_sequence: bool = False,
    ) -> None:
        super().__init__(config=config)
        self.arena_dtype = arena_dtype  # None: the model's key and value dtype
        self.per_sequence = per_sequence
        if not supports_batching(config):
            raise ValueError("the model has layers the slot cache cannot batch")
        self.max_slots = max_slots
        self.reserved = [0] * max_slots  # most positions an extent grows to (0: no bound)
        self._offsets: list[int | None] = [None] * max_slots
        self._capacities = [0] * max_slots
        self.positions = 0  # arena size, every layer alike
        # Copies the layers make at the start of the next pass, in order (an extent moved
        # to make room); ``prepare`` starts a new list.
        self.relocations: list[Relocation] = []
        self.batch = SlotBatch([0], [0], 1, 0)
        count = len(self.layers) or config.num_hidden_layers
        self.layers = [SlotLayer(self) for _ in range(count)]
        self.layer_class_to_replicate = None

    @property
    def slot_layers(self) -> list[SlotLayer]:
        return [layer for layer in self.layers if isinstance(layer, SlotLayer)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.batch.kv_length

    def offset(self, slot: int) -> int:
        offset = self._offsets[slot]
        assert offset is not None, f"slot {slot} has no extent"
        return offset

    def capacity(self, slot: int) -> int:
        return self._capacities[slot]

    def allocated_positions(self) -> int:
        """The arena's size in positions (per layer; keys and values alike)."""
        return self.positions

    def reserve(self, slot: int, positions: int) -> None:
        """Bound the slot's growth to ``positions`` (a pass that needs more still gets it)."""
        self.reserved[slot] = positions

    def prepare(self, batch: SlotBatch) -> None:
        """Give every slot of ``batch`` room for its rows and set the pass's indices."""
        self.relocations = []
        for slot, start in zip(batch.slots, batch.starts, strict=True):
            if start + batch.rows > self._capacities[slot]:
                self._grow(slot, start + batch.rows)
        offsets = torch.tensor([self.offset(slot) for slot in batch.slots])
        starts = torch.tensor(batch.starts)
        rows = torch.arange(batch.rows)
        batch.write_index = (offsets + starts)[:, None].add(rows[None, :]).reshape(-1)
        if len(batch.slots) > 1 and self.per_sequence:
            batch.spans = [
                (self.offset(slot), start + batch.rows)
                for slot, start in zip(batch.slots, batch.starts, strict=True)
            ]
        elif len(batch.slots) > 1:
            last = starts + batch.rows - 1
            positions = torch.minimum(torch.arange(batch.kv_length)[None, :], last[:, None])
            batch.read_index = (offsets[:, None] + positions).reshape(-1)
        self.batch = batch

    def _grow(self, slot: int, needed: int) -> None:
        """Room for ``needed`` positions in the slot's extent: a free run of the arena where
        one is long enough; otherwise the extents packed to the front and the slot's own
        widened in place (those behind it moved up), the arena grown only by what is still
        missing. So the arena never holds more than the extents' sum."""
        old, limit = self._capacities[slot], self.reserved[slot]
        doubled = max(INITIAL_CAPACITY, 2 * old)
        capacity = max(needed, min(doubled, limit) if limit else doubled)
        source = self._offsets[slot]
        target = self._free_run(capacity)
        if target is not None:
            if source is not None and old:
                self.relocations.append(Relocation(source, target, old))
        else:
            self._pack()
            target = self._end() if source is None else self.offset(slot)
            widen = capacity - old
            behind = [extent for extent in self._live() if extent[0] > target]
            for offset, length, other in reversed(behind):  # the last first: none overwritten
                self.relocations.append(Relocation(offset, offset + widen, length))
                self._offsets[other] = offset + widen
        self._offsets[slot], self._capacities[slot] = target, capacity
        self.positions = max(self.positions, self._end())

    def _live(self) -> list[tuple[int, int, int]]:
        """(offset, capacity, slot) of every extent, by offset."""
        return sorted(
            (offset, self._capacities[slot], slot)
            for slot, offset in enumerate(self._offsets)
            if offset is not None
        )

    def _end(self) -> int:
        return max((offset + capacity for offset, capacity, _ in self._live()), default=0)

    def _free_run(self, size: int) -> int | None:
        """The first free run of ``size`` positions within the arena, or None."""
        cursor = 0
        for offset, capacity, _ in self._live():
            if offset - cursor >= size:
                return cursor
            cursor = max(cursor, offset + capacity)
        return cursor if self.positions - cursor >= size else None

    def _pack(self) -> None:
        """Move every extent to the front, in order (each moves toward lower positions, so
        copying in that order never overwrites an extent not yet moved)."""
        cursor = 0
        for offset, capacity, slot in self._live():
            if offset != cursor:
                self.relocations.append(Relocation(offset, cursor, capacity))
                self._offsets[slot] = cursor
            cursor += capacity

    def move(self, slot: int, source: list[int], target: list[int]) -> None:
        """Within ``slot``, copy the entries at ``source`` indices to ``target`` indices."""
        offset = self.offset(slot)
        for layer in self.slot_layers:
            layer.move([offset + i for i in source], [offset + i for i in target])

    def move_slot(self, source: int, target: int) -> None:
        """The sequence in ``source`` is in ``target`` now (which must be free)."""
        self._offsets[target], self._offsets[source] = self._offsets[source], None
        self._capacities[target], self._capacities[source] = self._capacities[source], 0
        self.reserved[target], self.reserved[source] = self.reserved[source], 0

    def release(self, slot: int) -> None:
        """The slot's extent is free space again; its reservation goes."""
        self._offsets[slot] = None
        self._capacities[slot] = 0
        self.reserved[slot] = 0
