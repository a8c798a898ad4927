"""Load checkpoints from local Hugging Face directories and check that a draft fits a target."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from engine.api.types import IncompatibleDraftError
from engine.config import DType
from engine.models.attention import use_cpu_gqa_attention
from engine.models.dtype_choice import DtypeChoice, faster_cpu_dtype

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def pick_device(requested: str | None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# Below this many parameters a model is overhead-bound on CPU and float32 is as fast.
SMALL_MODEL_PARAMETERS = 20_000_000


@functools.cache
def cpu_has_native_bfloat16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(
    requested: DType, device: torch.device, num_parameters: int,
    config: PretrainedConfig | None = None,
) -> DtypeChoice:
    """``auto``: bfloat16 on CUDA (float16 where bf16 is missing). On CPU, for models large
    enough to be memory-bound, the dtype measured faster for the model's layer shapes
    (``engine.models.dtype_choice``) where the CPU computes bf16 natively, else float32."""
    if requested != "auto":
        return DtypeChoice(requested, _DTYPES[requested], "requested")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(requested, torch.bfloat16, "CUDA")
        return DtypeChoice(requested, torch.float16, "CUDA without bfloat16")
    if num_parameters < SMALL_MODEL_PARAMETERS:
        return DtypeChoice(requested, torch.float32, "a small model is not memory-bound")
    if not cpu_has_native_bfloat16():
        return DtypeChoice(requested, torch.float32, "this CPU emulates bfloat16")
    hidden = getattr(config, "hidden_size", None)
    intermediate = getattr(config, "intermediate_size", None)
    if isinstance(hidden, int) and isinstance(intermediate, int):
        return faster_cpu_dtype(hidden, intermediate)
    return DtypeChoice(requested, torch.bfloat16, "native bfloat16, layer shapes unknown")


def choose_dtype(model_dir: Path, device: torch.device, requested: DType) -> DtypeChoice:
    """The dtype ``load_model`` loads ``model_dir`` in, and why (``pick_dtype``)."""
    config = text_config(AutoConfig.from_pretrained(model_dir, local_files_only=True))
    return pick_dtype(requested, device, checkpoint_parameters(model_dir), config)


def checkpoint_parameters(model_dir: Path) -> int:
    """Number of parameters stored in the directory's safetensors files, read from their
    headers (0 when there are none), so the dtype can be chosen before loading."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += math.prod(f.get_slice(name).get_shape())
    return total


def load_model(model_dir: Path, device: torch.device, dtype: DType) -> PreTrainedModel:
    """``from_pretrained`` from a local directory in the chosen dtype, then moved to ``device``
    (on CPU with the grouped-head attention of ``engine.models.attention``).

    The dtype goes to ``from_pretrained`` rather than a cast afterwards, so transformers'
    own rules hold: buffers it keeps in float32 (the rotary ``inv_freq``: in bfloat16 its
    cos is off by up to 1.5 at position 1000) and the class's ``_keep_in_fp32_modules``.
    """
    chosen = choose_dtype(model_dir, device, dtype).dtype
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=chosen)
    torch.nn.Module.to(model, device=device)  # moves only; dtypes stay as loaded
    use_cpu_gqa_attention(model)
    return model.eval()


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config of the text decoder: ``text_config`` of a multimodal model (Gemma 3 4B and
    up), the config itself otherwise."""
    return config.get_text_config(decoder=True)


def context_window(config: PretrainedConfig, default: int = 2048) -> int:
    """Positions the model was built for, from its text config (GPT-2 calls it n_positions)."""
    text = text_config(config)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def embedding_rows(model: PreTrainedModel) -> int:
    """Rows of the output layer: the ids the model can score (padded beyond the tokenizer's
    tokens in many checkpoints)."""
    return int(model.get_output_embeddings().weight.shape[0])


def input_rows(model: PreTrainedModel) -> int:
    """Rows of the input embeddings: the ids the model can read (a draft's output head may
    cover only a subset of them, ``engine.speculation.proposers.vocabulary``)."""
    weight = model.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor)
    return int(weight.shape[0])


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def check_draft_compatible(
    target: PreTrainedTokenizerBase,
    draft: PreTrainedTokenizerBase,
    draft_rows: int,
    target_rows: int,
) -> None:
    """Judge a draft on its tokenizer: over the ids both tokenizers define, the same token at
    the same id, and the same special tokens. Embedding rows beyond the tokenizer (padding,
    as in the Qwen2.5 family) are ignored. The draft must embed every id the target's
    tokenizer defines, since it reads the target's output."""
    problems: list[str] = []
    target_tokens = _tokens_by_id(target)
    draft_tokens = _tokens_by_id(draft)
    shared = min(len(target_tokens), len(draft_tokens), draft_rows, target_rows)
    differing = [i for i in range(shared) if target_tokens[i] != draft_tokens[i]]
    if differing:
        examples = [(i, target_tokens[i], draft_tokens[i]) for i in differing[:3]]
        problems.append(
            f"the tokenizers have different tokens at the same ids: {len(differing)} of the "
            f"{shared} shared ids differ (id, target, draft: {examples})"
        )
    if draft_rows < len(target_tokens):
        problems.append(
            f"the draft embeds only {draft_rows} ids but the target's tokenizer defines "
            f"{len(target_tokens)}"
        )
    for name in ("bos_token_id", "eos_token_id"):
        t, d = getattr(target, name), getattr(draft, name)
        if t != d:
            problems.append(f"{name} {d} (draft) != {t} (target)")
    if problems:
        raise IncompatibleDraftError(
            "draft model is incompatible with the target: " + "; ".join(problems)
        )


def _tokens_by_id(tokenizer: PreTrainedTokenizerBase) -> list[str | None]:
    """Token string per id, ``None`` for holes in the id range."""
    vocab = tokenizer.get_vocab()
    tokens: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    return tokens
