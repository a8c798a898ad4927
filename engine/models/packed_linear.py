"""Linear layers with their weights prepacked for oneDNN, for serving on CPU.

A decode pass on CPU is a stream of matrix-vector products over every weight. ``F.linear``
hands the BLAS an ordinary row-major weight at every call (oneDNN in bfloat16, which then
reorders it into its blocked layout per call; MKL's ``sgemm`` in float32). Packing each weight
once at load (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing pass does)
lets every pass run oneDNN's blocked kernel straight from the packed copy, for one row
(decode) and a few (verification) alike. In bfloat16 that makes a decode step markedly
cheaper; in float32 it makes little difference inside the model (figures:
``bench/results/2026-12-06-engine-batching-and-kernels.md``).

``pack_linear_weights`` first fuses the input projections of Llama-family layers
(``engine.models.fused_projections``: q/k/v and gate/up each one packed product) and packs the
other linears one by one.

The products sum in another order than ``F.linear``'s (as any change of BLAS kernel does), so
logits differ from an unpacked model's within the dtype's rounding; the engine's plain and
speculative passes all run the packed model, so they agree with each other as before.

The original ``weight`` parameter stays on the module (a tied output head shares it with the
input embeddings; proposers read the target's head; autograd needs it), which costs a second
copy of the weights in memory. A pass with autograd recording runs ``F.linear`` on it.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from engine.kernels import small_gemm
from engine.models.fused_projections import fuse_projections

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


@cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of ``dtype`` on this CPU: its bfloat16 path needs
    AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT and refuses elsewhere (AVX2-only CPUs), where
    bfloat16 layers keep ``F.linear``."""
    if not torch.backends.mkldnn.is_available() or dtype not in _PACKABLE_DTYPES:
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros((16, 16), dtype=dtype))
    except RuntimeError:
        return False
    return True


def can_pack(linear: torch.nn.Linear) -> bool:
    """Whether oneDNN takes this layer: a CPU weight in float32, or in bfloat16 where this
    CPU has oneDNN's bfloat16 path."""
    weight = linear.weight
    return (
        weight.device.type == "cpu"
        and onednn_packs(weight.dtype)
        and (linear.bias is None or linear.bias.dtype == weight.dtype)
    )


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` (same ``weight`` and ``bias`` parameters) that runs inference passes
    on a oneDNN-packed copy of its weight (float32 where the small-product kernel is built:
    its panels, ``engine.kernels.small_gemm``)."""

    packed_weight: torch.Tensor

    def __init__(self, linear: torch.nn.Linear) -> None:
        torch.nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        # float32 where the small-product kernel is built: its panels (short passes) and
        # F.linear on the weight (long ones); otherwise oneDNN's packed copy for every pass.
        self.small = small_gemm.applies(linear.weight)
        with torch.no_grad():
            weight = linear.weight.detach()
            packed = (small_gemm.pack(weight) if self.small
                      else torch.ops.mkldnn._reorder_linear_weight(weight))
        self.register_buffer("packed_weight", packed, persistent=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (input.requires_grad or self.weight.requires_grad):
            return F.linear(input, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        if self.small:
            out = small_gemm.product(input, self.packed_weight, self.out_features, bias)
            return F.linear(input, self.weight.detach(), bias) if out is None else out
        return torch.ops.mkldnn._linear_pointwise(
            input, self.packed_weight, bias, "none", [], ""
        )


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Fuse the input projections of Llama-family layers into packed products
    (``engine.models.fused_projections``), then replace every other packable ``nn.Linear`` of
    ``model`` by a ``PackedLinear`` over the same parameters, in place; returns how many
    linears were packed, fused ones included. Idempotent."""
    fused = {id(linear) for linear in fuse_projections(model, can_pack)}
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear and can_pack(child) and id(child) not in fused
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets) + len(fused)
