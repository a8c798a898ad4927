"""Every method on the architectures teams deploy, over tiny random checkpoints built from
transformers' own config classes: greedy n-gram and draft speculation equal plain decoding
over prompts that cross the sliding window (or attention chunk), and plain decoding equals
Hugging Face ``generate``. Float32, where exactness is defined (docs/engine.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

from engine.api.types import (
    GenerationRequest,
    MethodUnavailableError,
    SamplingParams,
    SpeculativeChoice,
)
from engine.config import EngineConfig, SpeculativeConfig
from engine.models.batched_runner import Feed
from engine.models.kv_cache import save_recurrent_states
from engine.models.model_runner import ModelRunner
from engine.models.serial_runner import SerialRunner
from engine.serving.service import Engine
from engine.speculation.proposers.draft import DraftProposer
from tests.engine.test_engine_sampling import (
    SIGNIFICANCE,
    chi_square_p_value,
    draw,
    exact_pair_distribution,
    next_token_probs,
)
from tests.tiny_models import build_tokenizer

WINDOW = 8  # sliding window / attention chunk: the prompt alone crosses it
NEW_TOKENS = 28
HIDDEN = 32


def _common(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    return {
        "vocab_size": len(tokenizer) + 8,  # padded, as most checkpoints are
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
    }


def _decoder(**extra: Any) -> dict[str, Any]:
    """The fields most decoder configs share, two layers deep."""
    return {
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        **extra,
    }


HYBRID = ["sliding_attention", "full_attention"]


def _gemma3_multimodal(common: dict[str, Any]) -> PretrainedConfig:
    text = {**_decoder(head_dim=8, sliding_window=WINDOW, layer_types=HYBRID), **common}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    return transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        tie_word_embeddings=False,
    )


# name -> config builder from the common token fields. Windows are WINDOW tokens.
ARCHITECTURES: dict[str, Callable[[dict[str, Any]], PretrainedConfig]] = {
    "llama": lambda c: transformers.LlamaConfig(**_decoder(), **c),
    "qwen2": lambda c: transformers.Qwen2Config(**_decoder(), **c),
    "qwen2-sliding": lambda c: transformers.Qwen2Config(
        **_decoder(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), **c
    ),
    "qwen2-moe": lambda c: transformers.Qwen2MoeConfig(
        **_decoder(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
                   shared_expert_intermediate_size=HIDDEN), **c
    ),
    "mistral-sliding": lambda c: transformers.MistralConfig(
        **_decoder(sliding_window=WINDOW), **c
    ),
    "gemma2": lambda c: transformers.Gemma2Config(
        **_decoder(head_dim=8, sliding_window=WINDOW, layer_types=HYBRID), **c
    ),
    "gemma3-text": lambda c: transformers.Gemma3TextConfig(
        **_decoder(head_dim=8, sliding_window=WINDOW, layer_types=HYBRID), **c
    ),
    "gemma3-multimodal": _gemma3_multimodal,
    "phi3-sliding": lambda c: transformers.Phi3Config(
        **_decoder(sliding_window=WINDOW), **c
    ),
    "gpt2": lambda c: transformers.GPT2Config(
        n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=256, **c
    ),
    "gpt-neox": lambda c: transformers.GPTNeoXConfig(
        **_decoder(num_key_value_heads=None), **{**c, "tie_word_embeddings": False}
    ),
    "gpt-oss": lambda c: transformers.GptOssConfig(
        **_decoder(head_dim=8, sliding_window=WINDOW, layer_types=HYBRID,
                   num_local_experts=4, num_experts_per_tok=2), **c
    ),
    "llama4-chunked": lambda c: transformers.Llama4TextConfig(
        **_decoder(head_dim=8, attention_chunk_size=WINDOW, intermediate_size_mlp=2 * HIDDEN,
                   num_local_experts=2, interleave_moe_layer_step=2, no_rope_layers=[1, 0]),
        **c,
    ),
    "lfm2-conv-hybrid": lambda c: transformers.Lfm2Config(
        **_decoder(layer_types=["conv", "full_attention"]), **c
    ),
    "cohere2": lambda c: transformers.Cohere2Config(
        **_decoder(sliding_window=WINDOW, layer_types=HYBRID), **c
    ),
    "olmo3": lambda c: transformers.Olmo3Config(
        **_decoder(sliding_window=WINDOW, layer_types=HYBRID), **c
    ),
    "smollm3": lambda c: transformers.SmolLM3Config(**_decoder(), **c),
    "mamba": lambda c: transformers.MambaConfig(
        hidden_size=HIDDEN, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=4, **c
    ),
    "qwen3-next-hybrid": lambda c: transformers.Qwen3NextConfig(
        **_decoder(head_dim=8, layer_types=["linear_attention", "full_attention"],
                   linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                   linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1,
                   moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=HIDDEN),
        **c,
    ),
}


def _peaked(model: torch.nn.Module, seed: int, noise: float = 0.0) -> None:
    """Scale the output head so the random model has peaked, varied distributions; with
    ``noise`` perturb every weight (a draft that mostly agrees with its target)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if noise:
            for param in model.parameters():
                if param.numel() > 1 and param.is_floating_point():
                    param.add_(torch.randn(param.shape, generator=generator) * param.std() * noise)
        else:
            head = model.get_output_embeddings()
            assert head is not None
            head.weight.mul_(8.0)


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def build(root: Path, name: str, tokenizer: PreTrainedTokenizerFast) -> tuple[Path, Path]:
    """Target and a noisy copy of it (the draft, same architecture, same window)."""
    config = ARCHITECTURES[name](_common(tokenizer))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _peaked(model, seed=0)
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    _peaked(model, seed=1, noise=0.2)
    model.save_pretrained(root / "draft")
    tokenizer.save_pretrained(root / "draft")
    return root / "target", root / "draft"


# Multi-token passes after a cache are wrong in transformers' implementation (engine.models.compat).
CANNOT_VERIFY = {"mamba"}

PROMPT = "for i in range(10):\n    print(i * i)\n"  # 20 tokens, more than the window


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_method_equals_plain_decoding_and_transformers(
    name: str, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    target, draft = build(tmp_path, name, tokenizer)
    spec = SpeculativeConfig(
        acceptance_threshold=0.0, min_speedup=0.0, max_speculative_tokens=4
    )
    engine = Engine.load(EngineConfig(target=target, draft=draft, dtype="float32",
                                      speculative=spec, cpu_threads=1))
    try:
        prompt = tokenizer.encode(PROMPT)
        assert len(prompt) > 2 * WINDOW
        # From the text config (Gemma 3's is nested); Mamba has no position limit to read.
        assert engine.max_context == (2048 if name == "mamba" else 256)

        def run(method: str, k: int | None) -> list[int]:
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
            choice = SpeculativeChoice(method, k)  # type: ignore[arg-type]
            result = engine.generate(GenerationRequest(tuple(prompt), params, choice))
            stats = result.stats
            if k is not None:
                assert stats.num_draft_tokens > 0, (method, stats)
            if method == "draft" and k is not None:  # rollbacks past the window, both caches
                assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
            return list(result.token_ids)

        plain = run("none", None)
        reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        reference.generation_config.eos_token_id = None  # as ignore_eos: EOS is a token
        expected = reference.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id,
        )[0, len(prompt):].tolist()
        assert plain == expected
        if name in CANNOT_VERIFY:
            assert not engine.can_speculate and engine.available_methods == ("none",)
            with pytest.raises(MethodUnavailableError):
                run("ngram", 3)
            return
        assert engine.can_speculate
        for method, k in (("ngram", 3), ("draft", 3), ("draft", None), ("ngram", None)):
            assert run(method, k) == plain, (method, k)
    finally:
        engine.close()


def test_a_sliding_window_draft_drafts_for_a_shared_batch_through_the_one_proposer(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target that batches, its draft one whose cache slots cannot share a pass (Mistral's
    sliding window): the same ``DraftProposer`` drafts, its pool on a ``SerialRunner`` with a
    slot per sequence, drafting for every sequence of a step; greedy outputs of the shared batch
    equal plain decoding, with rollbacks past the draft's window."""
    mistral, draft = build(tmp_path, "mistral-sliding", tokenizer)
    # The same weights as a Llama (full attention; Mistral's layout): a target that batches.
    llama = transformers.LlamaForCausalLM(ARCHITECTURES["llama"](_common(tokenizer)))
    llama.load_state_dict(AutoModelForCausalLM.from_pretrained(mistral).state_dict())
    llama.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    spec = SpeculativeConfig(acceptance_threshold=0.0, min_speedup=0.0, max_speculative_tokens=4)
    engine = Engine.load(EngineConfig(target=tmp_path / "llama", draft=draft, dtype="float32",
                                      speculative=spec, max_num_seqs=3, cpu_threads=1))
    try:
        assert engine.batching
        prototype = engine._proposers["draft"]
        assert isinstance(prototype, DraftProposer)
        pool = prototype.pool
        assert isinstance(pool.runner, SerialRunner)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        prompt = tokenizer.encode(PROMPT)
        prompts = [tuple(prompt[i:]) for i in range(3)]

        def request(prompt: tuple[int, ...], method: str) -> GenerationRequest:
            return GenerationRequest(prompt, params, SpeculativeChoice(method, 3))  # type: ignore[arg-type]

        plain = [engine.generate(request(p, "none")).token_ids for p in prompts]
        feeds_per_pass: list[int] = []
        forward = pool.runner.forward

        def spy(feeds: list[Feed], last_only: bool = False) -> list[torch.Tensor]:
            feeds_per_pass.append(len(feeds))
            return forward(feeds, last_only)

        monkeypatch.setattr(pool.runner, "forward", spy)
        handles = [engine.submit(request(p, "draft")) for p in prompts]
        results = [handle.result() for handle in handles]
        assert [result.token_ids for result in results] == plain
        assert max(feeds_per_pass) == len(prompts)  # one step drafted for all three
        for result in results:
            assert 0 < result.stats.num_accepted_tokens < result.stats.num_draft_tokens
    finally:
        engine.close()


# Each step feeds that many tokens (> 0) then keeps all but ``drop`` of them, as a
# verification pass followed by a rollback does; several feeds in a row before a rollback
# are what a draft model does while it proposes.
rollback_steps = st.lists(
    st.tuples(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(0, 4)),
    min_size=1, max_size=8,
)


# One of each cache kind: sliding window, sliding + full, linear attention + full, conv + full.
# (Mamba, recurrent only, is left out: transformers' Mamba cannot continue a cached state
# over several tokens at all, so the engine does not speculate on it; see engine.models.compat.)
ROLLBACK_KINDS = ["mistral-sliding", "gemma3-text", "qwen3-next-hybrid", "lfm2-conv-hybrid"]


@pytest.fixture(scope="module")
def rollback_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelRunner]:
    tokenizer = build_tokenizer()
    runners = {}
    for name in ROLLBACK_KINDS:
        target, _ = build(tmp_path_factory.mktemp(name), name, tokenizer)
        runners[name] = ModelRunner(
            AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        )
    return runners


@pytest.mark.parametrize("name", ROLLBACK_KINDS)
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=rollback_steps, seed=st.integers(0, 2**16))
def test_rolled_back_cache_continues_like_a_fresh_one(
    name: str, rollback_models: dict[str, ModelRunner], steps: list[tuple[list[int], int]],
    seed: int,
) -> None:
    """Sliding-window, hybrid and recurrent caches: after any feeds and rollbacks, across the
    window, the next pass's logits equal those of one fresh pass over the kept tokens."""
    runner = rollback_models[name]
    generator = torch.Generator().manual_seed(seed)
    kept = torch.randint(3, 300, (2 * WINDOW,), generator=generator).tolist()
    runner.reset()
    runner.forward(kept, last_only=True)
    for feeds, drop in steps:
        fed: list[int] = []
        for size in feeds:
            tokens = torch.randint(3, 300, (size,), generator=generator).tolist()
            runner.forward(tokens)
            fed += tokens
        keep = max(0, len(fed) - drop)
        runner.truncate(len(kept) + keep)
        kept += fed[:keep]
    assert runner.length == len(kept)
    states = save_recurrent_states(runner.cache)
    nxt = [5, 6]
    got = runner.forward(nxt)
    runner.reset()
    runner.forward(kept, last_only=True)
    for rolled, fresh in zip(states, save_recurrent_states(runner.cache), strict=True):
        for index, state in fresh.items():  # the recurrent state itself, not only its effect
            assert torch.allclose(rolled[index], state, atol=1e-6, rtol=1e-4)
    expected = runner.forward(nxt)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()


@pytest.mark.parametrize("name", ["mistral-sliding", "qwen3-next-hybrid"])
def test_sampling_past_the_window_draws_from_the_target(
    name: str, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    """Rejection sampling with rollbacks past the window (sliding cache) and by replay
    (recurrent state): the first two sampled tokens after a prompt longer than the window
    follow the target's exact joint distribution (chi-square, as
    tests/engine/test_engine_sampling)."""
    target, draft = build(tmp_path, name, tokenizer)
    spec = SpeculativeConfig(acceptance_threshold=0.0, min_speedup=0.0)
    engine = Engine.load(EngineConfig(target=target, draft=draft, dtype="float32",
                                      speculative=spec, cpu_threads=1))
    try:
        params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
        prompt = tokenizer.encode(PROMPT)
        draft_model = engine._proposers["draft"].pool.runner.model  # type: ignore[attr-defined]
        p = next_token_probs(engine._target.model, [prompt], params)[0]
        q = next_token_probs(draft_model, [prompt], params)[0]
        assert 0.05 < 0.5 * float((p - q).abs().sum()) < 0.95  # a wrong rule would show
        exact = exact_pair_distribution(engine, prompt, params)
        counts = draw(engine, prompt, params, "draft")
        assert chi_square_p_value(counts, exact) > SIGNIFICANCE
    finally:
        engine.close()
