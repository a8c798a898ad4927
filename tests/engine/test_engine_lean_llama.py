"""The lean Llama forward (``engine.models.lean_llama``) computes what HF's modules compute.

On a tiny fused Llama model, the batched runner's lean passes give bitwise the logits and
hidden states of the same runner on HF's modules (``lean=False``), in float32 and bfloat16,
over ragged prefill with padding rows, decode rows with and without other sequences (decode
passes attend without a mask), trees, rollbacks and kept tree paths; against the unfused HF
model in float32 within 1e-4 with the same greedy tokens; and batched greedy decoding gives
each sequence the tokens of its decoding alone on HF's modules. Models the lean forward does
not cover keep HF's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.models.batched_cache import SlotBatch
from engine.models.batched_runner import BatchedRunner, Feed
from engine.models.lean_llama import LeanLlama, lean_model
from engine.models.loading import load_model
from engine.models.packed_linear import onednn_packs
from tests.tiny_models import build_three_layer_target, load_packed

CPU = torch.device("cpu")
FLOAT32_TOLERANCE = 1e-4  # against the unfused model: sums in another order


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_three_layer_target(tmp_path_factory, "lean", seed=5)


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * s) % 250 + 4 for i in range(n)] for s, n in enumerate((9, 23, 4, 15))]


def passes() -> list[tuple[list[Feed], bool]]:
    """(feeds, last_only) in order over 4 slots: every kind of pass the engine runs (several
    feeds with last_only: a ``fill``)."""
    chunks = prompts()
    return [
        ([Feed(0, chunks[0])], True),  # a prefill chunk alone
        ([Feed(s, chunks[s]) for s in (1, 2, 3)], False),  # ragged prefill, padding rows
        ([Feed(s, [40 + s]) for s in range(4)], False),  # decode rows, no mask
        ([Feed(2, [50])], False),  # one decode row alone
        ([Feed(0, [41]), Feed(1, [42, 50, 51, 52, 53], (-1, -1, 0, 0)), Feed(3, [43, 60])],
         False),  # a decode row beside a tree and a chain (padded)
        ([Feed(s, [44 + s, 45]) for s in range(4)], True),  # a fill: no logits
        ([Feed(s, [46 + s]) for s in (3, 0, 1)], False),  # decode after it, slots reordered
    ]


def run(runner: BatchedRunner, hidden: bool) -> list[list[torch.Tensor]]:
    """Every pass's logits (and hidden states), with a rollback and a kept tree path."""
    out = []
    for index, (feeds, last_only) in enumerate(passes()):
        if last_only and len(feeds) > 1:
            runner.fill(feeds)
        elif hidden and not last_only:
            logits, states = runner.forward_hidden(feeds)
            out += [logits, states]
        else:
            out.append(runner.forward(feeds, last_only=last_only))
        if index == 4:
            runner.truncate(0, runner.lengths[0] - 1)  # reject the decode row
            runner.keep_path(1, runner.lengths[1] - 4, [0, 2])  # node 0 and its child 2
    return out


# The lean forward runs fused products, which bfloat16 has only where oneDNN packs it.
FUSED_DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not onednn_packs(torch.bfloat16), reason="oneDNN packs no bfloat16 on this CPU"))]


@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("hidden", [False, True])
def test_lean_passes_give_hf_modules_logits_bitwise(target: Path, dtype: str, hidden: bool) -> None:
    model = load_packed(target, dtype)
    lean = BatchedRunner(model, max_slots=4)
    modules = BatchedRunner(model, max_slots=4, lean=False)
    assert isinstance(lean.lean, LeanLlama) and modules.lean is None
    got, expected = run(lean, hidden), run(modules, hidden)
    assert len(got) == len(expected)
    for one, other in zip(got, expected, strict=True):
        assert [t.shape for t in one] == [t.shape for t in other]
        assert all(torch.equal(a, b) for a, b in zip(one, other, strict=True))
    assert lean.lengths == modules.lengths


def test_a_padded_pass_runs_its_products_over_each_feeds_own_rows(target: Path) -> None:
    """Only attention sees the padded layout: beside a five-row tree, a decode row and a
    two-row chain cost one and two rows of every product, not five each."""
    runner = BatchedRunner(load_packed(target, "float32"), max_slots=3)
    for slot in range(3):
        runner.forward([Feed(slot, prompts()[slot])], last_only=True)
    assert runner.lean is not None
    rows: list[int] = []

    def counted(product: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(input: torch.Tensor) -> torch.Tensor:
            rows.append(input.reshape(-1, input.shape[-1]).shape[0])
            return product(input)
        return run

    for layer in runner.lean.layers:
        for fused in (layer.qkv, layer.gate_up):
            fused.product = counted(fused.product)  # type: ignore[method-assign]
    runner.forward([Feed(0, [41]), Feed(1, [42, 50, 51, 52, 53], (-1, -1, 0, 0)),
                    Feed(2, [43, 60])])
    assert len(rows) == 2 * len(runner.lean.layers) and set(rows) == {1 + 5 + 2}


def test_lean_passes_match_the_unfused_model_in_float32(target: Path) -> None:
    lean = BatchedRunner(load_packed(target, "float32"), max_slots=4)
    unfused = BatchedRunner(load_model(target, CPU, "float32"), max_slots=4)
    assert lean.lean is not None and unfused.lean is None
    for one, other in zip(run(lean, False), run(unfused, False), strict=True):
        for a, b in zip(one, other, strict=True):
            assert (a - b).abs().max().item() <= FLOAT32_TOLERANCE
            assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_greedy_decoding_gives_each_sequence_its_tokens_alone(
    target: Path, dtype: str
) -> None:
    model = load_packed(target, dtype)

    def decode(runner: BatchedRunner, slots: list[int], steps: int) -> dict[int, list[int]]:
        chunks = prompts()
        tokens = {}
        for slot in slots:
            logits = runner.forward([Feed(slot, chunks[slot])], last_only=True)[0]
            tokens[slot] = [int(logits[-1].argmax())]
        for _ in range(steps):
            out = runner.forward([Feed(slot, [tokens[slot][-1]]) for slot in slots])
            for slot, logits in zip(slots, out, strict=True):
                tokens[slot].append(int(logits[-1].argmax()))
        return tokens

    batched = decode(BatchedRunner(model, max_slots=4), [0, 1, 2, 3], 12)
    for slot in range(4):
        alone = decode(BatchedRunner(model, max_slots=4, lean=False), [slot], 12)
        assert batched[slot] == alone[slot]


def test_models_the_lean_forward_does_not_cover_keep_hf_modules(target: Path) -> None:
    assert lean_model(load_model(target, CPU, "float32")) is None  # not fused
    eager = load_packed(target, "float32")
    eager.set_attn_implementation("eager")
    assert lean_model(eager) is None
    hooked = load_packed(target, "float32")
    hooked.model.layers[1].mlp.register_forward_hook(lambda *_: None)
    assert lean_model(hooked) is None
    assert BatchedRunner(hooked, max_slots=2).lean is None
    assert lean_model(load_packed(target, "float32")) is not None


def test_per_sequence_attention_of_several_rows_needs_a_mask(target: Path) -> None:
    lean = BatchedRunner(load_packed(target, "float32"), max_slots=2)
    for slot in range(2):
        lean.forward([Feed(slot, prompts()[slot][:5])], last_only=True)
    assert lean.lean is not None
    ids = torch.tensor([[4, 5], [6, 7]])
    positions = torch.tensor([[5, 6], [5, 6]])
    slots = SlotBatch([0, 1], [5, 5], 2, 7)
    lean.cache.prepare(slots)
    with pytest.raises(ValueError, match="needs the pass's mask"), torch.inference_mode():
        lean.lean.forward(ids, positions, None, lean.cache, slots.spans, None)


def test_a_hook_registered_after_the_runner_was_built_is_called(target: Path) -> None:
    """A forward hook put on the model later (a test's perturbation of verification, a
    profiler) sees every pass: the lean forward, which would skip it, gives way to HF's."""
    runner = BatchedRunner(load_packed(target, "float32"), max_slots=2)
    assert runner.lean is not None
    seen: list[int] = []
    hook = runner.model.register_forward_hook(
        lambda _module, _inputs, output: seen.append(output.logits.shape[1])
    )
    try:
        runner.forward([Feed(0, [5, 6, 7])])
        runner.forward([Feed(0, [8])])
    finally:
        hook.remove()
    assert seen == [3, 1]
