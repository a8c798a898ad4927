"""Loading the checkpoints users bring: transformers' dtype rules, padded vocabularies,
multimodal configs, drafts with a shorter window than the target's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from engine.api.types import (
    GenerationRequest,
    IncompatibleDraftError,
    SamplingParams,
    SpeculativeChoice,
)
from engine.config import EngineConfig, SpeculativeConfig
from engine.models.loading import check_draft_compatible, load_model, text_config
from engine.models.model_runner import ModelRunner
from engine.serving.service import Engine
from engine.training.demo.tokenizer import train_tokenizer
from tests.tiny_models import SAMPLE_TEXT, build_model, build_tokenizer

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def greedy(engine: Engine, prompt: list[int], method: str, max_tokens: int = 24) -> list[int]:
    request = GenerationRequest(
        tuple(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        SpeculativeChoice(method),  # type: ignore[arg-type]
    )
    return list(engine.generate(request).token_ids)


def test_bfloat16_logits_past_position_1000_equal_transformers_own(tmp_path: Path) -> None:
    """A Llama-3-shaped rotary (theta 500000): the engine's bfloat16 model must be the one
    ``from_pretrained(dtype=bfloat16)`` gives, float32 ``inv_freq`` buffer included."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # logits of a few units, as a trained model's
    model.save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    engine_model = load_model(tmp_path, torch.device("cpu"), "bfloat16")
    assert engine_model.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = torch.randint(0, 128, (1, 1040), generator=torch.Generator().manual_seed(1))
    prefix, tail = ids[0, :1000].tolist(), ids[0, 1000:].tolist()

    def logits_past_1000(model: torch.nn.Module) -> torch.Tensor:
        runner = ModelRunner(model)  # type: ignore[arg-type]
        runner.forward(prefix, last_only=True)
        return runner.forward(tail)

    # The same passes over both models: any difference is the model's, not the pass split's
    # (with a bfloat16 inv_freq they differ by 0.017 here, 0.35 % of the largest logit).
    assert torch.equal(logits_past_1000(engine_model), logits_past_1000(reference))
    with torch.inference_mode():
        whole = reference(input_ids=ids).logits[0, 1000:].float()
    assert torch.allclose(logits_past_1000(engine_model), whole, atol=0.05, rtol=0.02)


@pytest.mark.parametrize(
    ("attribute", "dtype"),
    [("_keep_in_fp32_modules", "float16"), ("_keep_in_fp32_modules_strict", "bfloat16")],
)
def test_keep_in_fp32_modules_stay_float32(tmp_path: Path, attribute: str, dtype: str) -> None:
    """transformers keeps a class's ``_keep_in_fp32_modules`` in float32 under float16 and
    its ``_keep_in_fp32_modules_strict`` under bfloat16 too (gpt-oss's router, say)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    original = getattr(LlamaForCausalLM, attribute)
    setattr(LlamaForCausalLM, attribute, ["lm_head"])
    try:
        model = load_model(tmp_path, torch.device("cpu"), dtype)  # type: ignore[arg-type]
    finally:
        setattr(LlamaForCausalLM, attribute, original)
    assert model.lm_head.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.up_proj.weight.dtype == getattr(torch, dtype)


def test_padded_vocabulary_draft_is_accepted_and_exact(tmp_path: Path) -> None:
    """The Qwen2.5 pairing: one tokenizer, embedding matrices padded to different sizes."""
    tokenizer = build_tokenizer()
    real = len(tokenizer)
    target = build_model(tmp_path / "t", tokenizer, seed=0, vocab_size=real + 64)
    draft = build_model(tmp_path / "d", tokenizer, seed=1, hidden=32, layers=1,
                        vocab_size=real + 8)
    spec = SpeculativeConfig(acceptance_threshold=0.0, min_speedup=0.0)
    engine = Engine.load(EngineConfig(target=target, draft=draft, dtype="float32",
                                      speculative=spec))
    try:
        prompt = tokenizer("def add(a, b):\n    return")["input_ids"]
        plain = greedy(engine, prompt, "none")
        assert greedy(engine, prompt, "draft") == plain
        sampled = GenerationRequest(
            tuple(prompt),
            SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True),
            SpeculativeChoice("draft", 3),
        )
        result = engine.generate(sampled)
        assert result.stats.num_draft_tokens > 0
        assert all(t < real + 64 for t in result.token_ids)
    finally:
        engine.close()


def test_draft_with_other_tokens_at_the_same_ids_is_refused(tmp_path: Path) -> None:
    target = build_tokenizer()
    other = train_tokenizer([text[::-1] for text in SAMPLE_TEXT], vocab_size=len(target))
    with pytest.raises(IncompatibleDraftError, match="different tokens at the same ids"):
        check_draft_compatible(target, other, draft_rows=len(other), target_rows=len(target))


def test_draft_that_cannot_embed_the_targets_tokens_is_refused() -> None:
    tokenizer = build_tokenizer()
    with pytest.raises(IncompatibleDraftError, match="embeds only"):
        check_draft_compatible(tokenizer, tokenizer, draft_rows=len(tokenizer) - 10,
                               target_rows=len(tokenizer))


def test_draft_with_a_shorter_window_steps_aside_past_it(tmp_path: Path) -> None:
    """A GPT-2 draft (learned positions: it cannot run past them) of 64 positions drafting
    for a 512-position target: long prompts decode exactly, the draft silent past 64."""
    tokenizer = build_tokenizer()
    target = build_model(tmp_path / "t", tokenizer, seed=0)
    torch.manual_seed(2)
    draft_config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=1, n_head=2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    GPT2LMHeadModel(draft_config).save_pretrained(tmp_path / "d")
    tokenizer.save_pretrained(tmp_path / "d")
    spec = SpeculativeConfig(acceptance_threshold=0.0, min_speedup=0.0)
    engine = Engine.load(EngineConfig(target=target, draft=tmp_path / "d", dtype="float32",
                                      speculative=spec))
    try:
        assert engine.max_context == 512
        prompt = tokenizer("for i in range(10):\n    print(i * i)\n" * 2)["input_ids"]
        assert 30 < len(prompt) < 64
        plain = greedy(engine, prompt, "none", max_tokens=40)
        assert greedy(engine, prompt, "draft", max_tokens=40) == plain
        longer = prompt * 2
        assert len(longer) > 64
        assert greedy(engine, longer, "draft") == greedy(engine, longer, "none")
        fixed_k = SpeculativeChoice("draft", 4)
        silent = engine.generate(GenerationRequest(tuple(longer), GREEDY, fixed_k))
        assert silent.stats.num_draft_tokens == 0  # past its 64 positions the draft is silent
        early = engine.generate(GenerationRequest(tuple(prompt), GREEDY, fixed_k))
        assert early.stats.num_draft_tokens > 0
    finally:
        engine.close()


def test_text_config_of_a_multimodal_config() -> None:
    from transformers import Gemma3Config

    config = Gemma3Config(
        text_config={"vocab_size": 99, "max_position_embeddings": 777, "hidden_size": 32},
    )
    text = text_config(config)
    assert text.vocab_size == 99 and text.max_position_embeddings == 777
