"""What the engine does differently off the CPU, checked on the CPU: CUDA is picked where
present, with bfloat16 (float16 where bf16 is missing) under ``dtype: auto``, and a model on
another device keeps Hugging Face's SDPA attention and its plain linears, so no CPU-only
path (grouped-head attention, oneDNN packing, the compiled kernels, the lean Llama forward)
runs there. The model is moved to PyTorch's ``meta`` device, which has tensors of every shape
and no CPU, as CUDA would be seen by these checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import small_gemm
from engine.models.attention import CPU_GQA_SDPA, use_cpu_gqa_attention
from engine.models.batched_runner import BatchedRunner
from engine.models.lean_llama import lean_model
from engine.models.loading import load_model, pick_device, pick_dtype
from engine.models.packed_linear import PackedLinear, pack_linear_weights
from tests.tiny_models import build_pair


def test_cuda_is_picked_where_present_and_a_requested_device_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device(None) == torch.device("cuda")
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device(None) == torch.device("cpu")


@pytest.mark.parametrize(("bf16", "expected"), [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_dtype_on_cuda(
    monkeypatch: pytest.MonkeyPatch, bf16: bool, expected: torch.dtype
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16)
    choice = pick_dtype("auto", torch.device("cuda"), num_parameters=10**9)
    assert choice.dtype == expected
    assert "CUDA" in choice.reason
    assert pick_dtype("float32", torch.device("cuda"), 10**9).dtype == torch.float32


def test_off_the_cpu_the_model_keeps_hugging_faces_attention_and_linears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, _ = build_pair(tmp_path)
    on_cpu = load_model(target, torch.device("cpu"), "float32")
    assert on_cpu.config._attn_implementation == CPU_GQA_SDPA  # the CPU path, for contrast

    # load_model on another device (the move is made to give meta tensors): the attention
    # is chosen after the move.
    monkeypatch.setattr(torch.nn.Module, "to", lambda module, **_: module._apply(_to_meta))
    model = load_model(target, torch.device("meta"), "float32")
    assert model.device.type == "meta"
    assert model.config._attn_implementation == "sdpa"
    use_cpu_gqa_attention(model)
    assert model.config._attn_implementation == "sdpa"
    assert pack_linear_weights(model) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert not small_gemm.applies(model.lm_head.weight)
    assert lean_model(model) is None
    assert BatchedRunner(model, max_slots=2).lean is None


def _to_meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor, device="meta")
