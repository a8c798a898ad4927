"""The compiled decode attention (``engine.kernels.decode_attention``): SDPA's results within
float32 rounding, and every row computed independently of the rest of its pass.

Against PyTorch's SDPA per sequence (the fallback) over random shapes: ragged extents of an
arena, ancestor masks of trees behind a cached prefix, padding rows, grouped KV heads, head
sizes off the vector width, and caches given per batch row instead of as an arena. Bitwise:
a sequence's rows alone equal its rows in a batch, and a decode row equals row 0 of a
verification pass over the same prefix; on a tiny model the runner's logits keep both
properties (SDPA's decode row and verification row 0 differ in their last bits). Without a
compiler the library is not built and the engine runs SDPA.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels import build, decode_attention
from engine.models.batched_runner import BatchedRunner, Feed
from engine.speculation.tree import ancestor_mask
from tests.tiny_models import build_three_layer_target, load_packed

# Float32 sums in another order, outputs of order one; scores up to ~20 in magnitude (scale
# 0.3 over 96 dimensions), whose rounding moves a weight by |score| ulps: 4e-6 seen.
TOLERANCE = 1e-5

pytestmark = pytest.mark.skipif(
    not decode_attention.available(), reason=f"no kernel: {decode_attention.status()}"
)


def reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    mask: torch.Tensor | None, spans: list[tuple[int, int]], scale: float,
) -> torch.Tensor:
    """SDPA per sequence over its extent, ``[batch, rows, heads, dim]``."""
    outs = []
    for b, (offset, length) in enumerate(spans):
        row_mask = None if mask is None else mask[b : b + 1, :, :, :length]
        outs.append(F.scaled_dot_product_attention(
            query[b : b + 1], keys[:, :, offset : offset + length],
            values[:, :, offset : offset + length], attn_mask=row_mask, scale=scale,
            enable_gqa=True,
        ))
    return torch.cat(outs).transpose(1, 2)


@st.composite
def passes(draw: st.DrawFn) -> tuple[object, ...]:
    """(query, arena keys, arena values, mask or None, spans, scale): ragged sequences, each
    a cached prefix and its fed rows (a chain or a tree, then padding rows), in one arena."""
    batch = draw(st.integers(1, 5))
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))
    dim = draw(st.sampled_from([8, 16, 20, 64, 96]))
    rows = draw(st.integers(1, 6))
    decode = rows == 1 and draw(st.booleans())
    cached = [draw(st.integers(0 if not decode else 1, 90)) for _ in range(batch)]
    gaps = [draw(st.integers(0, 20)) for _ in range(batch)]
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    spans, cursor = [], 0
    kv_length = max(cached) + rows
    mask = torch.zeros((batch, 1, rows, kv_length), dtype=torch.bool)
    for b in range(batch):
        fed = draw(st.integers(1, rows))
        parents = tuple(draw(st.integers(-1, i - 1)) for i in range(fed - 1))
        start = cached[b]
        mask[b, 0, :, :start] = True
        mask[b, 0, :fed, start : start + fed] = ancestor_mask(parents)
        mask[b, 0, fed:, start] = True  # padding rows see row 0
        length = start + (1 if decode else rows)
        spans.append((cursor + gaps[b], length))
        cursor += gaps[b] + length
    shape = (1, kv_heads, cursor + 3, dim)
    keys = torch.randn(shape, generator=generator)
    values = torch.randn(shape, generator=generator)
    query = torch.randn((batch, heads, rows, dim), generator=generator)
    if draw(st.booleans()):  # the lean forward's layout: heads not adjacent in memory
        wide = torch.randn((batch, rows, heads + 2, dim), generator=generator)
        wide[:, :, :heads] = query.transpose(1, 2)
        query = wide[:, :, :heads].transpose(1, 2)
    scale = draw(st.sampled_from([dim**-0.5, 0.3]))
    return query, keys, values, None if decode else mask, spans, scale


@settings(max_examples=150, deadline=None)
@given(passes())
def test_the_kernel_gives_sdpa_per_sequence_within_float32_rounding(case: tuple) -> None:
    query, keys, values, mask, spans, scale = case
    out = decode_attention.attend(query, keys, values, mask, spans, scale)
    assert out is not None
    expected = reference(query, keys, values, mask, spans, scale)
    assert torch.allclose(out, expected, atol=TOLERANCE, rtol=TOLERANCE)


@settings(max_examples=60, deadline=None)
@given(passes())
def test_each_sequence_alone_gives_its_rows_in_the_batch_bitwise(case: tuple) -> None:
    query, keys, values, mask, spans, scale = case
    together = decode_attention.attend(query, keys, values, mask, spans, scale)
    assert together is not None
    for b, (offset, length) in enumerate(spans):
        # alone: its extent as the batch-one cache gives it, a view, with no other rows
        alone = decode_attention.attend(
            query[b : b + 1], keys[:, :, offset : offset + length],
            values[:, :, offset : offset + length],
            None if mask is None else mask[b : b + 1, :, :, :length], None, scale,
        )
        assert alone is not None
        assert torch.equal(alone[0], together[b])


@settings(max_examples=60, deadline=None)
@given(passes(), st.data())
def test_padding_rows_are_skipped_and_the_own_rows_unchanged(
    case: tuple, data: st.DataObject
) -> None:
    """With each batch row's own row count, the rows beyond it are not attended (zeros) and
    the own rows are bitwise those of the pass that attends every row."""
    query, keys, values, mask, spans, scale = case
    batch, rows = query.shape[0], query.shape[2]
    counts = [data.draw(st.integers(1, rows)) for _ in range(batch)]
    every = decode_attention.attend(query, keys, values, mask, spans, scale)
    own = decode_attention.attend(query, keys, values, mask, spans, scale, counts)
    assert every is not None and own is not None
    for b, n in enumerate(counts):
        assert torch.equal(own[b, :n], every[b, :n])
        assert not own[b, n:].any()


@settings(max_examples=60, deadline=None)
@given(passes(), st.integers(1, 15))
def test_a_decode_row_is_row_0_of_a_verification_pass_bitwise(case: tuple, extra: int) -> None:
    """Row 0 of a pass of 1 + ``extra`` rows sees the prefix and itself, as a decode row does;
    the other rows' columns are masked, and the extent is longer."""
    query, keys, values, _, spans, scale = case
    decode = decode_attention.attend(query[:, :, :1], keys, values, None, spans, scale)
    rows = 1 + extra
    longer = [(offset, length + extra) for offset, length in spans]
    arena_end = max(offset + length for offset, length in longer)
    if arena_end > keys.shape[2]:
        pad = torch.randn((1, keys.shape[1], arena_end - keys.shape[2], keys.shape[3]))
        keys, values = torch.cat((keys, pad), 2), torch.cat((values, pad.flip(3)), 2)
    widened = torch.randn((query.shape[0], query.shape[1], rows, query.shape[3]))
    widened[:, :, :1] = query[:, :, :1]
    mask = torch.zeros((len(spans), 1, rows, max(length for _, length in longer)), dtype=torch.bool)
    for b, (_, length) in enumerate(spans):
        mask[b, 0, :, : length - 1] = True  # the prefix, then the rows' causal chain
        mask[b, 0, :, length - 1 : length - 1 + rows] = torch.ones(rows, rows).tril().bool()
    verification = decode_attention.attend(widened, keys, values, mask, longer, scale)
    assert decode is not None and verification is not None
    assert torch.equal(decode[:, :1], verification[:, :1])


def test_layouts_the_kernel_does_not_take_are_left_to_sdpa() -> None:
    query, keys = torch.randn(2, 3, 1, 8), torch.randn(1, 3, 10, 8)
    spans = [(0, 4), (4, 5)]
    doubled = keys.double()
    assert decode_attention.attend(query.double(), doubled, doubled, None, spans, 1.0) is None
    several = torch.randn(2, 3, 2, 8)
    assert decode_attention.attend(several, keys, keys, None, spans, 1.0) is None  # needs a mask
    additive = torch.zeros(2, 1, 2, 9)
    assert decode_attention.attend(several, keys, keys, additive, spans, 1.0) is None
    assert decode_attention.attend(query, keys, keys.clone().transpose(2, 3).contiguous()
                                   .transpose(2, 3), None, spans, 1.0) is None  # other strides
    with decode_attention.switched_off():
        assert not decode_attention.available()
        assert decode_attention.attend(query, keys, keys, None, spans, 1.0) is None


def test_a_build_is_loaded_only_where_current_and_runnable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library is built once, at install time; loading never compiles. A missing, stale
    or foreign build gives no library and says why (the callers then fall back)."""
    assert "not built" in (build.load("decode_attention.c", tmp_path).detail)
    (library, *_) = [
        path for path in build.build(directory=tmp_path) if path.name.startswith("decode_att")
    ]
    monkeypatch.setenv("CC", "false")  # loading must not need a compiler, or call one
    built = build.load("decode_attention.c", tmp_path)
    assert built.library is not None and "native" in built.detail
    manifest = json.loads(library.with_suffix(".json").read_text())
    stale = {**manifest, "source_sha256": "0" * 64}
    library.with_suffix(".json").write_text(json.dumps(stale))
    assert "another decode_attention.c" in build.load("decode_attention.c", tmp_path).detail
    foreign = {**manifest, "cpu_features": [*manifest["cpu_features"], "avx1024"]}
    library.with_suffix(".json").write_text(json.dumps(foreign))
    assert "avx1024" in build.load("decode_attention.c", tmp_path).detail


def test_a_failing_or_missing_compiler_builds_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "")
    with pytest.raises(SystemExit, match="no C compiler"):
        build.build(directory=tmp_path)
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.raises(SystemExit, match="failed"):
        build.build(directory=tmp_path)
    assert not [path for path in tmp_path.iterdir() if path.suffix == ".so"]  # no partial file


def test_the_images_portable_build_needs_only_its_targets_features(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build.build(portable=True, directory=tmp_path)
    built = build.load("decode_attention.c", tmp_path)
    assert built.library is not None
    needs = build.PORTABLE[build.platform.machine()][1]
    if needs:  # a CPU without what the portable build needs does not load it
        monkeypatch.setattr(build, "cpu_features", lambda: frozenset({"fpu", "sse2"}))
        built = build.load("decode_attention.c", tmp_path)
        assert built.library is None and needs[0] in built.detail


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_three_layer_target(tmp_path_factory, "kernel", seed=5)


def runner(target: Path, dtype: str) -> BatchedRunner:
    return BatchedRunner(load_packed(target, dtype), max_slots=4)


PROMPTS = [[(7 * i + 3 * s) % 250 + 4 for i in range(n)] for s, n in enumerate((9, 23, 4, 15))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_of_a_sequence_alone_are_its_row_in_the_batch_bitwise(
    target: Path, dtype: str
) -> None:
    alone, batched = runner(target, dtype), runner(target, dtype)
    for slot, prompt in enumerate(PROMPTS):
        alone.forward([Feed(slot, prompt)])
        batched.forward([Feed(slot, prompt)])
    for step in range(4):
        together = batched.forward([Feed(s, [40 + s + step]) for s in range(4)])
        for slot in range(4):
            assert torch.equal(alone.forward([Feed(slot, [40 + slot + step])])[0], together[slot])
    trees = [Feed(0, [5, 6, 7, 8], (-1, -1, 0)), Feed(1, [9]), Feed(2, [10, 11])]
    together = batched.forward(trees)
    for feed, logits in zip(trees, together, strict=True):
        assert torch.equal(alone.forward([feed])[0], logits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_step_gives_row_0_of_a_verification_pass_bitwise(
    target: Path, dtype: str
) -> None:
    """Plain and speculative passes attend identically (SDPA's differ in float32)."""
    model = runner(target, dtype)
    for slot, prompt in enumerate(PROMPTS):
        model.forward([Feed(slot, prompt)])
    decode = model.forward([Feed(s, [30 + s]) for s in range(4)])
    for slot in range(4):
        model.truncate(slot, model.lengths[slot] - 1)
    chains = [Feed(s, [30 + s, 50, 51, 52][: 1 + s]) for s in range(4)]
    verification = model.forward(chains)
    for slot in range(4):
        assert torch.equal(decode[slot][0], verification[slot][0])
    alone = model.forward([Feed(0, [60])])
    model.truncate(0, model.lengths[0] - 1)
    assert torch.equal(alone[0][0], model.forward([Feed(0, [60, 61, 62, 63, 64])])[0][0])
