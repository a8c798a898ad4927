"""Speed settings of the engine: passive OpenMP threads, ``--dtype auto`` measured, and the
prepacked linear weights it serves with (``engine.models.packed_linear``), and float32 attention for
half-precision steps (``engine.models.attention``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin

import engine.models.dtype_choice as dtype_choice
import engine.models.loading as loading
from engine.api.types import MAX_STEP_ROWS, GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.models.attention import FLOAT32_ATTENTION_ROWS, cpu_gqa_sdpa_forward
from engine.models.fused_projections import fuse_projections
from engine.models.packed_linear import PackedLinear, can_pack, onednn_packs
from engine.serving.service import Engine
from tests.tiny_models import build_model, build_tokenizer


def test_the_specgate_command_makes_openmp_threads_wait_passively() -> None:
    code = (
        "import os, sys; import gateway.cli; "
        "assert 'torch' not in sys.modules; print(os.environ['OMP_WAIT_POLICY'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "PASSIVE"


@pytest.mark.parametrize("slower", [torch.bfloat16, torch.float32])
def test_auto_dtype_is_the_one_measured_faster(
    monkeypatch: pytest.MonkeyPatch, slower: torch.dtype
) -> None:
    measured: list[tuple[torch.dtype, int]] = []

    def seconds(layers: list[torch.nn.Linear], inputs: dict[int, torch.Tensor]) -> float:
        dtype = layers[0].weight.dtype
        # as served: packed wherever oneDNN or the small-product kernel takes the dtype
        assert all(isinstance(layer, PackedLinear) or not can_pack(layer) for layer in layers)
        measured.append((dtype, next(iter(inputs.values())).shape[0]))
        return 2.0 if dtype == slower else 1.0

    monkeypatch.setattr(dtype_choice, "_sweep_seconds", seconds)
    monkeypatch.setattr(dtype_choice, "_COLD_BYTES", 1)  # one copy: nothing is timed here
    dtype_choice.faster_cpu_dtype.cache_clear()
    try:
        chosen = dtype_choice.faster_cpu_dtype(64, 128, verify_tokens=5)
    finally:
        dtype_choice.faster_cpu_dtype.cache_clear()
    assert chosen.dtype != slower and chosen.dtype in dtype_choice.CANDIDATES
    # The figures it chose by are on record (CPU seconds of a 1-row and a 5-row pass).
    assert chosen.as_record()["measured_cpu_s"] == {
        dtype_choice.dtype_name(d): 4.0 if d == slower else 2.0 for d in dtype_choice.CANDIDATES
    }
    assert chosen.as_record()["chosen"] == dtype_choice.dtype_name(chosen.dtype)
    assert set(measured) == {(d, rows) for d in dtype_choice.CANDIDATES for rows in (1, 5)}
    # Rounds alternate between the dtypes (a load change hits both alike).
    assert [d for d, rows in measured[:4:2]] == list(dtype_choice.CANDIDATES)


def test_pick_dtype_measures_large_models_on_cpus_with_native_bfloat16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[int, int]] = []

    def faster(hidden: int, intermediate: int) -> dtype_choice.DtypeChoice:
        asked.append((hidden, intermediate))
        return dtype_choice.DtypeChoice("auto", torch.float32, "measured", {"float32": 1.0})

    monkeypatch.setattr(loading, "faster_cpu_dtype", faster)
    monkeypatch.setattr(loading, "cpu_has_native_bfloat16", lambda: True)
    config = type("Config", (), {"hidden_size": 576, "intermediate_size": 1536})()
    cpu = torch.device("cpu")
    big = loading.SMALL_MODEL_PARAMETERS
    assert loading.pick_dtype("auto", cpu, big, config).reason == "measured"  # type: ignore[arg-type]
    assert asked == [(576, 1536)]
    small = loading.pick_dtype("auto", cpu, big - 1, config)  # type: ignore[arg-type]
    assert (small.dtype, small.reason) == (torch.float32, "a small model is not memory-bound")
    assert loading.pick_dtype("bfloat16", cpu, big, config).dtype == torch.bfloat16  # type: ignore[arg-type]
    assert asked == [(576, 1536)]
    monkeypatch.setattr(loading, "cpu_has_native_bfloat16", lambda: False)
    emulated = loading.pick_dtype("auto", cpu, big, config)  # type: ignore[arg-type]
    assert (emulated.dtype, emulated.reason) == (torch.float32, "this CPU emulates bfloat16")
    assert asked == [(576, 1536)]


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(
    torch.bfloat16, marks=pytest.mark.skipif(
        not onednn_packs(torch.bfloat16), reason="oneDNN packs no bfloat16 on this CPU"))])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 3, 48)])
def test_packed_linear_computes_the_layers_product_within_rounding(
    dtype: torch.dtype, bias: bool, shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80, bias=bias).to(dtype)
    packed = PackedLinear(layer)
    x = torch.randn(shape).to(dtype)
    with torch.inference_mode():
        got = packed(x)
    exact = x.double() @ layer.weight.double().T
    if layer.bias is not None:
        exact += layer.bias.double()
    assert got.shape == (*shape[:-1], 80) and got.dtype == dtype
    # The sum rounds to the dtype once per output, plus float32 accumulation over 48 terms.
    tolerance = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
    scale = x.double().abs() @ layer.weight.double().abs().T + 1.0
    assert ((got.double() - exact).abs() / scale).max() <= tolerance


def test_packed_linear_keeps_the_parameters_and_trains_through_them() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    packed = PackedLinear(layer)
    assert packed.weight is layer.weight and packed.bias is layer.bias
    x = torch.randn(3, 16, requires_grad=True)
    packed(x).square().sum().backward()
    expected = x.detach().clone().requires_grad_(True)
    weight, bias = layer.weight.detach(), layer.bias.detach()
    torch.nn.functional.linear(expected, weight, bias).square().sum().backward()
    assert x.grad is not None and expected.grad is not None
    torch.testing.assert_close(x.grad, expected.grad)
    assert layer.weight.grad is not None


def test_the_engine_serves_its_target_with_packed_linears_and_a_tied_head_stays_tied(
    tmp_path: Path,
) -> None:
    tokenizer = build_tokenizer()
    directory = build_model(tmp_path / "target", tokenizer, seed=0)
    config = AutoConfig.from_pretrained(directory)
    config.tie_word_embeddings = True
    tied = AutoModelForCausalLM.from_config(config)
    tied.save_pretrained(directory)
    model = loading.load_model(directory, torch.device("cpu"), "float32")
    plain = loading.load_model(directory, torch.device("cpu"), "float32")
    engine = Engine(EngineConfig(target=directory), model, tokenizer, "v")
    try:
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        fused = {id(m) for m in fuse_projections(model, can_pack)}  # already fused: a no-op
        assert linears and all(isinstance(m, PackedLinear) or id(m) in fused for m in linears)
        head = model.get_output_embeddings()
        assert head.weight is model.get_input_embeddings().weight
        prompt = tokenizer.encode("def add(a, b):\n")
        request = GenerationRequest(
            tuple(prompt), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        )
        expected = GenerationMixin.generate(
            plain,
            torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )[0, len(prompt):].tolist()
        assert list(engine.generate(request).token_ids) == expected
    finally:
        engine.close()


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("rows", [1, 5, FLOAT32_ATTENTION_ROWS + 1])
def test_half_precision_steps_attend_in_float32_and_prefill_chunks_as_they_are(
    grouped: bool, rows: int
) -> None:
    torch.manual_seed(0)
    kv_heads = 2 if grouped else 4
    module = torch.nn.Module()
    module.num_key_value_groups = 4 // kv_heads  # type: ignore[assignment]
    module.is_causal = True  # type: ignore[assignment]
    module.eval()
    query = torch.randn(1, 4, rows, 16).to(torch.bfloat16)
    key, value = (torch.randn(1, kv_heads, 40, 16).to(torch.bfloat16) for _ in range(2))
    mask = torch.ones(1, 1, rows, 40, dtype=torch.bool)
    mask[..., 40 - rows :] = torch.ones(rows, rows, dtype=torch.bool).tril()
    out, _ = cpu_gqa_sdpa_forward(module, query, key, value, mask, scaling=0.25)
    assert out.dtype == torch.bfloat16 and out.shape == (1, rows, 4, 16)

    def attend(dtype: torch.dtype) -> torch.Tensor:
        q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
        if not grouped:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True
        )

    in_float32 = rows <= FLOAT32_ATTENTION_ROWS
    expected = attend(torch.float32 if in_float32 else torch.bfloat16).to(torch.bfloat16)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=0)


def test_the_widest_verification_pass_attends_in_float32() -> None:
    """A pass of the longest proposal (``MAX_STEP_ROWS`` rows) attends as a decode row does;
    at 16 rows at most, a 16-node tree's 17-row pass attended in bfloat16."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups = 2  # type: ignore[assignment]
    module.eval()
    rows = MAX_STEP_ROWS
    query = torch.randn(1, 4, rows, 16).to(torch.bfloat16)
    key, value = (torch.randn(1, 2, 48, 16).to(torch.bfloat16) for _ in range(2))
    mask = torch.ones(1, 1, rows, 48, dtype=torch.bool)
    mask[..., 48 - rows :] = torch.ones(rows, rows, dtype=torch.bool).tril()
    out, _ = cpu_gqa_sdpa_forward(module, query, key, value, mask, scaling=0.25)
    expected = F.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=mask, scale=0.25, enable_gqa=True
    ).to(torch.bfloat16)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=0)
