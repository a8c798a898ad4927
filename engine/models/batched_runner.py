"""One causal LM running passes over many sequences at once, each in its own cache slot.

A pass takes per sequence a ``Feed``: the rows to run (row 0 is the sequence's last committed
token, or the first token of a prefill chunk; the others are proposal nodes or the rest of the
chunk), and the parent of each node. Row r goes to position ``cached + depth(r)`` and may see
the sequence's cached prefix, its own ancestors and itself (engine.speculation.tree's ancestor
mask); every sequence's rows are padded to the longest, and padding rows see only row 0. All rows
are stored behind the sequence's cached prefix; ``keep_path`` then keeps row 0 and the accepted
nodes and drops the rest, ``truncate`` is the plain rollback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from engine.models.attention import CPU_GQA_SDPA
from engine.models.batched_cache import SlotBatch, SlotCache
from engine.models.lean_llama import lean_model
from engine.speculation.tree import ancestor_mask, depths

# Attention implementations that take a boolean mask (True = attend); others get an additive one.
_BOOL_MASK_ATTENTION = ("sdpa", CPU_GQA_SDPA, "flash_attention_2")


@dataclass(frozen=True)
class Feed:
    """One sequence's rows in a pass. ``parents`` are the nodes' parents as in ``Proposal``
    (over ``tokens[1:]``, -1 = child of row 0); None means a chain."""

    slot: int
    tokens: list[int]
    parents: tuple[int, ...] | None = None


class BatchedRunner:
    """``invariant``: run each feed in a pass of its own, so that a sequence's logits do not
    depend on what shares the batch (batched kernels reduce in another order than a pass of
    one, which in bfloat16 can flip a greedy near-tie); slower, since passes are not shared."""

    def __init__(
        self,
        model: PreTrainedModel,
        max_slots: int,
        invariant: bool = False,
        lean: bool = True,
    ) -> None:
        self.model = model
        self.invariant = invariant
        self.device = model.device
        self.max_slots = max_slots
        # engine.models.attention's CPU attention reads each sequence's own extent (no gather) and
        # attends decode rows in float32, so a half-precision model's cache is kept in float32.
        self._per_sequence = model.config._attn_implementation == CPU_GQA_SDPA
        half = model.dtype in (torch.bfloat16, torch.float16)
        arena_dtype = torch.float32 if self._per_sequence and half else None
        self.cache = SlotCache(model.config, max_slots, arena_dtype, self._per_sequence)
        self.lengths = [0] * max_slots
        self._bool_mask = model.config._attn_implementation in _BOOL_MASK_ATTENTION
        # Fused Llama-shaped models run engine.models.lean_llama's forward (HF's arithmetic, fewer
        # calls); the rest HF's modules. Decided once: the model is packed before this.
        self.lean = lean_model(model) if lean else None

    def forward(self, feeds: list[Feed], last_only: bool = False) -> list[torch.Tensor]:
        """Run every feed; float32 logits ``[rows, vocab]`` per feed (``[1, vocab]`` with
        ``last_only``, which is for prefill chunks of one feed)."""
        if last_only and len(feeds) != 1:
            raise ValueError("last_only passes take one feed")
        return self._pass(feeds, last_only, want_hidden=False)[0]

    def fill(self, feeds: list[Feed]) -> None:
        """Store every feed's rows in its slot's cache, in one pass, computing no logits (a
        cache catching up on tokens whose predictions nobody needs)."""
        self._pass(feeds, True, want_hidden=False)

    def forward_hidden(self, feeds: list[Feed]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``forward`` of every row, with each feed's last hidden states ``[rows, hidden]``
        (the LM head's input, float32), for proposers that draft from them."""
        logits, hidden = self._pass(feeds, False, want_hidden=True)
        assert hidden is not None
        return logits, hidden

    def _pass(
        self, feeds: list[Feed], last_only: bool, want_hidden: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if not self.invariant or len(feeds) == 1:
            return self._shared_pass(feeds, last_only, want_hidden)
        logits: list[torch.Tensor] = []
        hidden: list[torch.Tensor] = []
        for feed in feeds:
            one, states = self._shared_pass([feed], last_only, want_hidden)
            logits += one
            hidden += states or []
        return logits, hidden if want_hidden else None

    @torch.inference_mode()
    def _shared_pass(
        self, feeds: list[Feed], last_only: bool, want_hidden: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        batch, rows = len(feeds), max(len(feed.tokens) for feed in feeds)
        starts = [self.lengths[feed.slot] for feed in feeds]
        kv_length = max(starts) + rows
        slots = SlotBatch([feed.slot for feed in feeds], starts, rows, kv_length)
        lean = self.lean is not None and self.lean.unhooked()
        if lean and rows == 1 and (batch == 1 or self._per_sequence):
            # One row per sequence sees all of its own prefix, and the lean forward attends
            # each sequence over its own extent: SDPA without a mask computes the same
            # (bitwise, tests/engine/test_engine_lean_llama.py), without converting one per call.
            self.cache.prepare(slots)
            ids = torch.tensor([feed.tokens for feed in feeds])
            positions = torch.tensor(starts)[:, None]
            return self._lean_pass(ids, positions, None, slots, [1] * batch, last_only,
                                   want_hidden)
        ids = torch.zeros((batch, rows), dtype=torch.long)
        positions = torch.zeros((batch, rows), dtype=torch.long)
        mask = torch.zeros((batch, 1, rows, kv_length), dtype=torch.bool)
        for b, (feed, start) in enumerate(zip(feeds, starts, strict=True)):
            n = len(feed.tokens)
            ids[b, :n] = torch.tensor(feed.tokens)
            mask[b, 0, :, :start] = True
            if feed.parents is None:  # a chain (prefill chunks, chain proposals): causal
                positions[b, :n] = start + torch.arange(n)
                mask[b, 0, :n, start : start + n] = torch.ones((n, n), dtype=torch.bool).tril()
            else:
                positions[b, :n] = start + torch.tensor([0, *depths(feed.parents)])
                mask[b, 0, :n, start : start + n] = ancestor_mask(feed.parents)
            positions[b, n:] = start
            mask[b, 0, n:, start] = True  # padding rows: see row 0, never read
        self.cache.prepare(slots)
        spans = {"slot_spans": slots.spans} if self._per_sequence and batch > 1 else {}
        attention = mask.to(self.device)
        sizes = [len(feed.tokens) for feed in feeds]
        if lean:
            return self._lean_pass(ids, positions, attention, slots, sizes, last_only, want_hidden)
        if not self._bool_mask:
            floor = torch.finfo(self.model.dtype).min
            attention = torch.zeros(mask.shape, dtype=self.model.dtype, device=self.device)
            attention.masked_fill_(~mask.to(self.device), floor)
        captured: list[torch.Tensor] = []
        hook = None
        if want_hidden:
            head = self.model.get_output_embeddings()
            assert head is not None

            def capture(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
                captured.append(inputs[0])

            hook = head.register_forward_pre_hook(capture)
        try:
            out = self.model(
                input_ids=ids.to(self.device),
                position_ids=positions.to(self.device),
                attention_mask=attention,
                cache=self.cache,
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
                **spans,
            )
        finally:
            if hook is not None:
                hook.remove()
        for feed in feeds:
            self.lengths[feed.slot] += len(feed.tokens)
        logits = out.logits.float()
        if last_only:  # the padded batch's last row (the feed's own where there is one)
            return [logits[b] for b in range(batch)], None
        hidden = None
        if captured:
            states = captured[0].float()
            hidden = [states[b, :n] for b, n in enumerate(sizes)]
        return [logits[b, :n] for b, n in enumerate(sizes)], hidden

    def _lean_pass(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        slots: SlotBatch,
        sizes: list[int],
        last_only: bool,
        want_hidden: bool,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The pass on ``self.lean`` (``mask`` None: one row per sequence) over each feed's own
        rows (padding only where attention needs the layout): the LM head over the rows
        returned only (each feed's rows; with ``last_only`` each feed's last)."""
        assert self.lean is not None
        batch, width = ids.shape
        rows = torch.tensor(sizes).cumsum(0) - 1 if last_only and width > 1 else None
        spans = slots.spans if self._per_sequence and batch > 1 else None
        logits, states = self.lean.forward(
            ids.to(self.device), positions.to(self.device), mask, self.cache, spans,
            None if rows is None else rows.to(self.device), sizes,
        )
        for b, n in enumerate(sizes):
            self.lengths[slots.slots[b]] += n
        counts = [1] * batch if last_only else sizes
        hidden = list(states.float().split(counts)) if want_hidden else None
        return list(logits.float().split(counts)), hidden

    def truncate(self, slot: int, length: int) -> None:
        if length > self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of {self.lengths[slot]} to {length}")
        self.lengths[slot] = length

    @torch.inference_mode()
    def keep_path(self, slot: int, committed_len: int, path: tuple[int, ...] | list[int]) -> None:
        """After a pass that fed the last committed token (stored at ``committed_len - 1``)
        and proposal nodes behind it, keep that token and the accepted ``path`` (node indices,
        root child first) contiguous behind the prefix; drop the rest. A chain's accepted
        prefix 0..m-1 already lies in place."""
        first = committed_len  # storage index of node 0
        source = [first + node for node in path]
        target = list(range(first, first + len(path)))
        moves = [(s, t) for s, t in zip(source, target, strict=True) if s != t]
        if moves:
            self.cache.move(slot, [s for s, _ in moves], [t for _, t in moves])
        self.truncate(slot, committed_len + len(path))

    @torch.inference_mode()
    def move_slot(self, source: int, target: int) -> None:
        """Move a sequence's cache from ``source`` to ``target`` (slot compaction)."""
        self.cache.move_slot(source, target)
        self.lengths[target] = self.lengths[source]
        self.lengths[source] = 0

    def release(self, slot: int) -> None:
        """The slot is empty: its cache memory and reservation go."""
        self.cache.release(slot)
        self.lengths[slot] = 0

    def reserve(self, slot: int, positions: int) -> None:
        """The most positions the slot's cache grows to (``SlotCache.reserve``)."""
        self.cache.reserve(slot, positions)
