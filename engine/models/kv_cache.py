"""A KV cache that appends in place and rolls back, for every kind of layer.

Transformers' ``DynamicCache`` grows each layer with ``torch.cat``, which copies the whole
cache at every step, and crops by slicing. Speculative decoding appends k+1 positions and
drops the rejected ones at every pass, so here each full-attention layer keeps a buffer with
spare room (doubled when full): an append writes into it, a rollback only lowers the length,
and attention reads views of the valid prefix.

Layers of other kinds keep transformers' own implementation, with its past recording
switched on: a sliding-window or chunked layer (Mistral, Gemma 2/3, Phi-3, gpt-oss, Llama 4)
and the convolution state of a linear-attention layer (Qwen3-Next) then keep every position
appended since the last crop, so a crop can drop rejected positions even past the window;
each crop shrinks them back to what the next pass needs. A linear-attention layer's
recurrent state is one matrix that every token updates and nothing can crop; for those the
runner snapshots it before each pass (``save_recurrent_states``) and, on rollback, restores
the snapshot (``crop_to_snapshot``) and feeds the accepted tokens again
(``engine.models.model_runner``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

INITIAL_CAPACITY = 256


class GrowableLayer(DynamicLayer):
    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self._keys = torch.empty(0)
        self._values = torch.empty(0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._keys = self._allocate(key_states, INITIAL_CAPACITY)
        self._values = self._allocate(value_states, INITIAL_CAPACITY)
        self.is_initialized = True

    @staticmethod
    def _allocate(like: torch.Tensor, capacity: int) -> torch.Tensor:
        batch, heads, _, dim = like.shape
        return like.new_empty((batch, heads, capacity, dim))

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self._keys.shape[2])
        keys = self._allocate(self._keys, capacity)
        values = self._allocate(self._values, capacity)
        keys[:, :, : self.length] = self._keys[:, :, : self.length]
        values[:, :, : self.length] = self._values[:, :, : self.length]
        self._keys, self._values = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[2]
        if end > self._keys.shape[2]:
            self._grow(end)
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        return self._set_length(end)

    def _set_length(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.length = length
        self.keys = self._keys[:, :, :length]
        self.values = self._values[:, :, :length]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers' sign convention)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes the negative number of positions to drop")
        if self.is_initialized:
            self._set_length(self.length + tokens_to_remove)

    def keep_rows(self, start: int, rows: torch.Tensor) -> None:
        """Move the positions ``rows`` (ascending, each at or after ``start``) to lie
        contiguously from ``start`` and drop everything after them: an accepted tree path.
        Copies only the kept rows (the index gathers them before anything is written)."""
        if not self.is_initialized:
            return
        end = start + len(rows)
        rows = rows.to(self._keys.device)
        self._keys[:, :, start:end] = self._keys.index_select(2, rows)
        self._values[:, :, start:end] = self._values.index_select(2, rows)
        self._set_length(end)

    def reset(self) -> None:
        self.length = 0
        self.is_initialized = False
        self.keys = self.values = None
        self._keys = self._values = torch.empty(0)


# transformers 5.25 keeps a history of recurrent states for crop (``recurrent_states_to_keep``,
# and a crop that takes the state it rolls back to from that history); earlier releases
# leave recurrent states to the caller.
_KEEPS_RECURRENT_HISTORY = "recurrent_states_to_keep" in inspect.signature(
    LinearAttentionCacheLayerMixin.activate_past_recording
).parameters


def new_cache(config: PretrainedConfig) -> DynamicCache:
    """The model's own cache layout, with every plain full-attention layer made growable and
    every other layer recording its past, so that all of them can roll back."""
    cache = DynamicCache(config=config)
    if cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = GrowableLayer
    cache.layers = [
        GrowableLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    if _KEEPS_RECURRENT_HISTORY:
        # The runner snapshots recurrent states once per pass; per-token history would make
        # transformers run each pass's last tokens one by one (its sequential scan).
        cache.activate_past_recording(recurrent_states_to_keep=0)
    else:
        cache.activate_past_recording()
    return cache


RecurrentStates = list[dict[int, torch.Tensor]]


def _recurrent_layers(cache: DynamicCache) -> list[LinearAttentionCacheLayerMixin]:
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def supports_trees(cache: DynamicCache) -> bool:
    """Whether every layer can keep an arbitrary accepted path (not just a prefix): only
    growable full-attention layers can; a sliding window or a recurrent state records its
    past in order, so such models verify chains only."""
    replicated = cache.layer_class_to_replicate
    return replicated in (None, GrowableLayer) and all(
        isinstance(layer, GrowableLayer) for layer in cache.layers
    )


def has_recurrent_state(cache: DynamicCache) -> bool:
    """Whether some layer keeps a state that a crop cannot roll back (linear attention)."""
    return bool(_recurrent_layers(cache))


def save_recurrent_states(cache: DynamicCache) -> RecurrentStates:
    """Copies of the recurrent states of the cache's linear-attention layers."""
    return [
        {
            index: state.clone()
            for index, state in layer.recurrent_states.items()
            if state is not None and layer.is_recurrent_states_initialized[index]
        }
        for layer in _recurrent_layers(cache)
    ]


def crop_to_snapshot(cache: DynamicCache, tokens: int, saved: RecurrentStates) -> None:
    """Drop the last ``tokens`` positions of a cache with recurrent layers and put back the
    recurrent states saved (``save_recurrent_states``) where the cache then ends.

    Since transformers 5.25 a crop also moves each recurrent state to an entry of the layer's
    own history, one entry per position; the runner records none (``new_cache``), so that
    history is filled with the current states first and the crop leaves them where they are.
    """
    if _KEEPS_RECURRENT_HISTORY:
        for layer in _recurrent_layers(cache):
            layer.recurrent_states_history = {
                index: [state] * tokens for index, state in layer.recurrent_states.items()
            }
    cache.crop(-tokens)
    _restore_recurrent_states(cache, saved)


def _restore_recurrent_states(cache: DynamicCache, saved: RecurrentStates) -> None:
    """Put back states from ``save_recurrent_states`` (in place: transformers keeps their
    addresses static)."""
    for layer, states in zip(_recurrent_layers(cache), saved, strict=True):
        for index, state in states.items():
            current = layer.recurrent_states[index]
            assert current is not None
            current.copy_(state)
