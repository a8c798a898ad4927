"""Batched passes attend each sequence over its own cache extent (``engine.models.attention`` with
``SlotBatch.spans``), from a float32 cache under a half-precision model.

The keys and values of a bfloat16 model are stored widened to float32 (exactly: every value
is a bfloat16 one), and a pass of several sequences reads each sequence's extent in place,
with no padded copy of the batch's keys and values. Its logits equal those of the padded,
gathered pass within bfloat16 rounding, with greedy tokens identical: ragged cached lengths,
padding rows, trees, and a pass wide enough to attend in bfloat16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models.batched_cache import SlotCache
from engine.models.batched_runner import BatchedRunner, Feed
from tests.tiny_models import build_three_layer_target, load_packed


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_three_layer_target(tmp_path_factory, "spans", seed=5)


def runners(target: Path, dtype: str) -> tuple[BatchedRunner, BatchedRunner]:
    """The served runner, and one over the same model that gathers padded keys and values."""
    model = load_packed(target, dtype)
    served = BatchedRunner(model, max_slots=3)
    gathering = BatchedRunner(model, max_slots=3)
    gathering.cache = SlotCache(model.config, 3)
    gathering._per_sequence = False
    return served, gathering


def test_a_bfloat16_model_keeps_its_cache_in_float32_and_gathers_nothing(target: Path) -> None:
    served, _ = runners(target, "bfloat16")
    served.forward([Feed(0, [5, 6, 7]), Feed(1, [8, 9])])
    layer = served.cache.slot_layers[0]
    assert layer._keys is not None and layer._keys.dtype == torch.float32
    assert served.cache.batch.read_index.numel() == 0  # no padded gather was indexed
    assert served.cache.batch.spans == [
        (served.cache.offset(0), 3), (served.cache.offset(1), 3)
    ]
    float32, _ = runners(target, "float32")
    float32.forward([Feed(0, [5, 6, 7])])
    keys = float32.cache.slot_layers[0]._keys
    assert keys is not None and keys.dtype == torch.float32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_per_sequence_attention_gives_the_gathered_passes_logits(target: Path, dtype: str) -> None:
    served, gathering = runners(target, dtype)
    prompts = [list(range(5, 5 + n)) for n in (9, 40, 4)]  # 40 rows: attends in bfloat16
    passes = [
        [Feed(slot, prompt) for slot, prompt in enumerate(prompts)],
        [Feed(0, [40]), Feed(1, [41, 50, 51, 52, 53], parents=(-1, -1, 0, 0)), Feed(2, [42, 60])],
        [Feed(0, [43]), Feed(1, [44]), Feed(2, [45])],
    ]
    tolerance = 1e-5 if dtype == "float32" else 0.1
    for feeds in passes:
        for got, expected in zip(served.forward(feeds), gathering.forward(feeds), strict=True):
            assert got.shape == expected.shape
            assert (got - expected).abs().max().item() <= tolerance
            assert torch.equal(got.argmax(-1), expected.argmax(-1))
    served.truncate(1, 41)  # a rollback, then the rows stored again
    gathering.truncate(1, 41)
    feeds = [Feed(0, [46]), Feed(1, [47, 48])]
    for got, expected in zip(served.forward(feeds), gathering.forward(feeds), strict=True):
        assert (got - expected).abs().max().item() <= tolerance
