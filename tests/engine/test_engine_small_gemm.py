"""The compiled small products (``engine.kernels.small_gemm``): ``F.linear``'s results within
float32 rounding, every row computed independently of the other rows of its call and of
how the columns are split between threads, and ``F.linear`` where the kernel does not apply.

Against ``F.linear`` in float64 over random shapes (rows 1 to MAX_ROWS, widths off the
panel width, with and without bias, strided input rows). Bitwise: each row of a call equals
that row alone, on one thread and on two. The packed layers (``engine.models.packed_linear``,
``engine.models.fused_projections``) run it for short float32 passes and ``F.linear`` on the
unpacked weights for long ones.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels import small_gemm
from engine.models.fused_projections import FusedPackedLinear
from engine.models.packed_linear import PackedLinear

pytestmark = pytest.mark.skipif(
    not small_gemm.available(), reason=f"no kernel: {small_gemm.status()}"
)


def tolerance(in_features: int) -> float:
    """A float32 sum of ``in_features`` products of standard normals, each rounded once (FMA):
    the error grows as in_features * eps * |partial sums| ~ in_features * 6e-8 * sqrt(in)."""
    return 1e-6 + 2e-7 * in_features ** 1.5


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, small_gemm.MAX_ROWS),
    in_features=st.integers(1, 300),
    out_features=st.integers(1, 70),
    with_bias=st.booleans(),
    row_gap=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_products_equal_f_linear_within_float32_rounding(
    rows: int, in_features: int, out_features: int, with_bias: bool, row_gap: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    wide = torch.randn(rows, in_features + row_gap, generator=generator)
    input = wide[:, :in_features]  # rows row_gap elements apart
    out = small_gemm.product(input, small_gemm.pack(weight), out_features, bias)
    assert out is not None and out.shape == (rows, out_features)
    expected = F.linear(input.double(), weight.double(), None if bias is None else bias.double())
    assert (out.double() - expected).abs().max().item() <= tolerance(in_features)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_alone_is_its_row_in_any_call_bitwise(threads: int) -> None:
    torch.manual_seed(3)
    weight = torch.randn(600, 520)  # enough elements for the helper thread to take half
    bias = torch.randn(600)
    packed = small_gemm.pack(weight)
    input = torch.randn(small_gemm.MAX_ROWS, 520)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = small_gemm.product(input, packed, 600, bias)
        alone = [small_gemm.product(input[i : i + 1], packed, 600, bias) for i in range(9)]
        middle = small_gemm.product(input[5:12], packed, 600, bias)
    finally:
        torch.set_num_threads(before)
    torch.set_num_threads(1)
    try:
        single = small_gemm.product(input, packed, 600, bias)
    finally:
        torch.set_num_threads(before)
    assert together is not None and middle is not None and single is not None
    for i, row in enumerate(alone):
        assert row is not None and torch.equal(row[0], together[i])
    assert torch.equal(middle, together[5:12])
    assert torch.equal(single, together)  # two threads split columns, not sums


def test_where_the_kernel_does_not_apply_it_gives_none() -> None:
    weight = torch.randn(8, 16)
    packed = small_gemm.pack(weight)
    too_many = torch.randn(small_gemm.MAX_ROWS + 1, 16)
    assert small_gemm.product(too_many, packed, 8, None) is None
    assert small_gemm.product(torch.randn(2, 16).double(), packed, 8, None) is None
    assert small_gemm.product(torch.randn(2, 16)[:, ::2], packed, 8, None) is None  # width 8
    assert small_gemm.product(torch.randn(16, 2).t(), packed, 8, None) is None  # strided columns
    assert not small_gemm.applies(weight.double())


def test_packed_layers_run_the_kernel_short_and_f_linear_long() -> None:
    torch.manual_seed(4)
    linears = [torch.nn.Linear(48, size) for size in (40, 24, 24)]
    for linear in linears:
        linear.requires_grad_(False)
    single, fused = PackedLinear(linears[0]), FusedPackedLinear(linears)
    assert single.small and fused.small
    weight = torch.cat([linear.weight for linear in linears])
    bias = torch.cat([linear.bias for linear in linears])
    with torch.inference_mode():
        for rows in (1, 5, small_gemm.MAX_ROWS, small_gemm.MAX_ROWS + 7):
            input = torch.randn(1, rows, 48)
            expected = F.linear(input.double(), weight.double(), bias.double()).float()
            assert torch.allclose(fused.product(input), expected, atol=tolerance(48), rtol=0)
            assert torch.allclose(single(input), expected[..., :40], atol=tolerance(48), rtol=0)
        short = torch.randn(3, 48)
        kernel = small_gemm.product(short, fused.packed_weight, 88, bias)
        assert kernel is not None and torch.equal(fused.product(short), kernel)


def test_switched_off_the_layers_keep_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECGATE_SMALL_GEMM", "onednn")
    small_gemm._built.cache_clear()
    try:
        assert not small_gemm.available() and "oneDNN" in small_gemm.status()
        layer = PackedLinear(torch.nn.Linear(16, 8).requires_grad_(False))
        assert not layer.small
        input = torch.randn(2, 16)
        with torch.inference_mode():
            assert torch.allclose(layer(input), F.linear(input, layer.weight, layer.bias),
                                  atol=1e-5, rtol=0)
    finally:
        monkeypatch.delenv("SPECGATE_SMALL_GEMM")
        small_gemm._built.cache_clear()
    assert small_gemm.available()


def test_a_process_forked_after_a_split_product_runs_its_own() -> None:
    """fork copies only the calling thread: a child that found the parent's helper marked as
    started would hand it half a product and wait for ever (a gateway or test forked after
    the engine loaded)."""
    torch.manual_seed(4)
    weight = torch.randn(600, 520)
    packed = small_gemm.pack(weight)
    input = torch.randn(4, 520)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected = small_gemm.product(input, packed, 600, None)  # starts the helper
        pid = os.fork()
        if pid == 0:  # the child: one split product, then out without Python's teardown
            got = small_gemm.product(input, packed, 600, None)
            os._exit(0 if got is not None and torch.equal(got, expected) else 1)
    finally:
        torch.set_num_threads(before)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's split product never finished")
