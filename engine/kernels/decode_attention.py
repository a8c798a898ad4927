"""One call of ``decode_attention.c`` per layer for a whole short pass, from PyTorch tensors.

``attend`` takes the attention of a pass of at most a few rows per sequence (decode rows,
verification chains and trees) in float32, every sequence over its own extent of the slot
cache's arena, and returns ``[batch, rows, heads, head_dim]``, or None where the kernel does
not apply (no library, not CPU float32, a layout it does not take); the caller then runs
PyTorch's SDPA. It replaces one SDPA call per sequence per layer (each about as dear whatever
the length up to a few hundred positions; figures in
bench/results/2026-12-06-engine-batching-and-kernels.md) and computes every row
independently of the rest of its pass (the C file says how), so a sequence's attention is
bitwise the same alone and in any batch, in a decode step and as row 0 of a verification (its
logits too, where the products do not round differently at another batch row count).

``SPECGATE_DECODE_ATTENTION=sdpa`` switches it off (PyTorch's path throughout).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch

from engine.kernels.build import Built, load_function

log = logging.getLogger(__name__)

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_switched_off = False


@cache
def _built() -> Built:
    built = load_function(
        "decode_attention.c",
        "specgate_attend",
        ctypes.c_int,
        [
            _PTR, _I64, _I64, _I64,  # query and its batch, head, row strides
            _PTR, _PTR, _I64, _I64, _I64,  # keys, values, batch, head, position strides
            _PTR, _PTR, _PTR,  # offsets, lengths, each batch row's own rows (or NULL)
            _PTR, _I64, _I64,  # mask and its batch, row strides
            _PTR,  # out
            _I64, _I64, _I64, _I64, _I64,  # batch, heads, kv heads, rows, dim
            ctypes.c_float,  # scale
        ],
        ("SPECGATE_DECODE_ATTENTION", "sdpa"),
    )
    if built.library is None:
        log.warning("decode attention: PyTorch SDPA per sequence (%s)", built.detail)
    return built


def available() -> bool:
    return _built().library is not None and not _switched_off


@contextmanager
def switched_off() -> Iterator[None]:
    """PyTorch's SDPA path inside (benchmarks comparing the two; tests of the fallback)."""
    global _switched_off
    before, _switched_off = _switched_off, True
    try:
        yield
    finally:
        _switched_off = before


def status() -> str:
    """Which decode attention runs, for the startup event."""
    built = _built()
    if built.library is None:
        return f"PyTorch SDPA per sequence ({built.detail})"
    return f"compiled kernel {built.detail}"


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    spans: list[tuple[int, int]] | None,
    scale: float,
    row_counts: list[int] | None = None,
) -> torch.Tensor | None:
    """Attention of ``query`` ``[batch, heads, rows, dim]`` over ``keys``/``values``: with
    ``spans``, the arenas ``[1, kv_heads, positions, dim]`` and batch row b over positions
    ``[offset, offset + length)``; without, ``[batch, kv_heads, length, dim]``. ``mask``:
    boolean ``[batch or 1, 1, rows, >= length]`` (True = attend), None for one row per
    sequence seeing all of its extent. ``row_counts``: batch row b's own rows, the first
    ``row_counts[b]``; the rest are padding, not attended, zeros in the result (None: all
    rows are its own). None where the kernel does not apply."""
    built = _built()
    if built.library is None or _switched_off or not _applies(query, keys, values, mask):
        return None
    batch, heads, rows, dim = query.shape
    kv_heads = keys.shape[1]
    if spans is None:
        if keys.shape[0] != batch:
            return None
        table = torch.tensor([[0] * batch, [keys.shape[2]] * batch], dtype=torch.long)
        kv_batch_stride = keys.stride(0)
    else:
        table = _span_table(spans)
        kv_batch_stride = 0
    if mask is not None and mask.shape[3] < int(table[1].max()):
        return None
    if mask is not None:
        mask_batch_stride = 0 if mask.shape[0] == 1 else mask.stride(0)
        mask_row_stride = mask.stride(2)
        mask_pointer = mask.data_ptr()
    else:
        mask_batch_stride = mask_row_stride = mask_pointer = 0
    own = None
    if row_counts is not None:
        if len(row_counts) != batch or not all(0 < n <= rows for n in row_counts):
            raise ValueError(f"row counts {row_counts} for {batch} batch rows of {rows}")
        own = _row_counts(row_counts)
    out = torch.empty((batch, rows, heads, dim), dtype=torch.float32)
    table_pointer = table.data_ptr()  # offsets, then lengths
    failed = built.library.specgate_attend(
        query.data_ptr(), query.stride(0), query.stride(1), query.stride(2),
        keys.data_ptr(), values.data_ptr(), kv_batch_stride, keys.stride(1), keys.stride(2),
        table_pointer, table_pointer + 8 * batch, None if own is None else own.data_ptr(),
        mask_pointer, mask_batch_stride, mask_row_stride,
        out.data_ptr(),
        batch, heads, kv_heads, rows, dim, scale,
    )
    if failed:
        raise MemoryError("decode attention: no scratch memory")
    return out


# Per kind, the last pass's list and its tensor, as one tuple: assigned in one step, so an
# engine in another thread can never pair one pass's list with another's tensor.
_last: dict[str, tuple[object, torch.Tensor]] = {}


def _of_pass(kind: str, values: list[Any]) -> torch.Tensor:
    """``values`` as int64 (a list of tuples: transposed), the last pass's tensor again when
    its layers hand the same list (one per pass: ``SlotCache.prepare`` makes new spans, the
    runner new row counts)."""
    last = _last.get(kind)
    if last is not None and last[0] is values:
        return last[1]
    rows = list(zip(*values, strict=True)) if values and isinstance(values[0], tuple) else values
    tensor = torch.tensor(rows, dtype=torch.long)
    _last[kind] = (values, tensor)
    return tensor


def _row_counts(counts: list[int]) -> torch.Tensor:
    return _of_pass("row_counts", counts)


def _span_table(spans: list[tuple[int, int]]) -> torch.Tensor:
    """Offsets, then lengths, as int64 ``[2, batch]``."""
    return _of_pass("spans", spans)


def _applies(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> bool:
    float32 = torch.float32
    if query.dtype != float32 or keys.dtype != float32 or values.dtype != float32:
        return False
    if query.device.type != "cpu" or keys.device.type != "cpu" or values.device.type != "cpu":
        return False
    strides = keys.stride()
    if query.stride(-1) != 1 or strides[-1] != 1 or strides != values.stride():
        return False
    if keys.shape != values.shape or query.shape[1] % keys.shape[1]:
        return False
    if mask is None:
        return query.shape[2] == 1
    return (
        mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
        and mask.shape[2] == query.shape[2] and mask.stride(-1) == 1
    )
