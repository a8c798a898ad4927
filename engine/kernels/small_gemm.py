"""The products of short passes (``small_gemm.c``) on float32 CPU weights, from PyTorch.

``pack`` lays a weight ``[out, in]`` out in the kernel's column panels once at load;
``product`` runs a pass of at most ``MAX_ROWS`` rows over it in one call, or gives None where
the kernel does not apply (no library, more rows, not contiguous float32 on the CPU); the
caller then runs ``F.linear`` on the unpacked weight. Each output row is computed
independently of the other rows of its call (the C file says how), so a sequence's products,
and with ``engine.kernels.decode_attention`` its logits, are bitwise the same alone and in
any batch of at most ``MAX_ROWS`` rows.

Figures: bench/results/2026-12-06-engine-batching-and-kernels.md, "The small products".

``SPECGATE_SMALL_GEMM=onednn`` switches it off (oneDNN's packed products throughout).
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

import torch

from engine.kernels.build import Built, load_function

log = logging.getLogger(__name__)

PANEL = 16  # the C file's PANEL
# Passes of more rows (prefill chunks longer than the default long_prefill_token_threshold)
# run F.linear: up to 128 rows the kernel is faster than MKL's sgemm on the demo target's
# shapes, beyond it oneDNN's blocked products catch up.
MAX_ROWS = 128
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@cache
def _built() -> Built:
    built = load_function(
        "small_gemm.c",
        "specgate_small_gemm",
        None,
        [
            _PTR, _I64, _I64, _I64,  # input, its row stride, rows, in_features
            _PTR, _PTR,  # packed weight, bias (or NULL)
            _PTR, _I64, _I64,  # out, its row stride, out_features
            _I64,  # threads
        ],
        ("SPECGATE_SMALL_GEMM", "onednn"),
    )
    if built.library is None:
        log.warning("small products: oneDNN packed weights (%s)", built.detail)
    return built


def available() -> bool:
    return _built().library is not None


def status() -> str:
    """Which kernel runs the products of short float32 passes, for the startup event."""
    built = _built()
    if built.library is None:
        return f"oneDNN packed weights ({built.detail})"
    return f"compiled kernel {built.detail} up to {MAX_ROWS} rows"


def applies(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is served by this kernel (float32 on the CPU, library built)."""
    return available() and weight.dtype == torch.float32 and weight.device.type == "cpu"


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` as ``[panels, in, PANEL]``: column j is lane j % PANEL of
    panel j // PANEL, zeros past the last column."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = weight.new_zeros((panels * PANEL, in_features))
    padded[:out_features] = weight
    return padded.view(panels, PANEL, in_features).transpose(1, 2).contiguous()


def product(
    input: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``F.linear(input, weight, bias)`` over ``packed = pack(weight)``, or None where the
    kernel does not apply."""
    built = _built()
    in_features = packed.shape[1]
    if built.library is None or input.dtype != torch.float32 or input.device.type != "cpu":
        return None
    if input.shape[-1] != in_features or (bias is not None and bias.dtype != torch.float32):
        return None
    flat = input.reshape(-1, in_features)
    rows = flat.shape[0]
    if rows > MAX_ROWS or rows == 0 or flat.stride(1) != 1:
        return None
    out = torch.empty((rows, out_features), dtype=torch.float32)
    bias = None if bias is None else bias.contiguous()
    built.library.specgate_small_gemm(
        flat.data_ptr(), flat.stride(0), rows, in_features,
        packed.data_ptr(), None if bias is None else bias.data_ptr(),
        out.data_ptr(), out_features, out_features, torch.get_num_threads(),
    )
    return out.view(*input.shape[:-1], out_features)
