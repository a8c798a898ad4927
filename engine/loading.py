"""Load checkpoints from local Hugging Face directories and check that a draft fits a target."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from engine.attention import use_cpu_gqa_attention
from engine.config import DType
from engine.dtype_choice import faster_cpu_dtype
from engine.types import IncompatibleDraftError

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
) -> torch.dtype:
    """``auto``: bfloat16 on CUDA (float16 where bf16 is missing). On CPU, for models large
    enough to be memory-bound, the dtype measured faster for the model's layer shapes
    (``engine.dtype_choice``) where the CPU computes bf16 natively, else float32."""
    if requested != "auto":
        return _DTYPES[requested]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if num_parameters >= SMALL_MODEL_PARAMETERS and cpu_has_native_bfloat16():
        hidden = getattr(config, "hidden_size", None)
        intermediate = getattr(config, "intermediate_size", None)
        if isinstance(hidden, int) and isinstance(intermediate, int):
            return faster_cpu_dtype(hidden, intermediate)
        return torch.bfloat16
    return torch.float32


def load_model(model_dir: Path, device: torch.device, dtype: DType) -> PreTrainedModel:
    """``from_pretrained`` from a local directory, then cast to the chosen dtype on ``device``
    (on CPU with the grouped-head attention of ``engine.attention``)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    chosen = pick_dtype(dtype, device, model.num_parameters(), model.config)
    torch.nn.Module.to(model, device=device, dtype=chosen)
    use_cpu_gqa_attention(model)
    return model.eval()


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def check_draft_compatible(
    target: PreTrainedTokenizerBase,
    draft: PreTrainedTokenizerBase,
    draft_vocab_size: int,
    target_vocab_size: int,
) -> None:
    """The draft must map every token id to the same token as the target does."""
    problems: list[str] = []
    if draft_vocab_size != target_vocab_size:
        problems.append(
            f"output vocabulary size {draft_vocab_size} (draft) != {target_vocab_size} (target)"
        )
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab != draft_vocab:
        only_target = sorted(set(target_vocab) - set(draft_vocab))
        only_draft = sorted(set(draft_vocab) - set(target_vocab))
        remapped = sorted(
            t for t in set(target_vocab) & set(draft_vocab) if target_vocab[t] != draft_vocab[t]
        )
        problems.append(
            f"tokenizer vocabularies differ: {len(only_target)} tokens only in the target "
            f"(e.g. {only_target[:3]}), {len(only_draft)} only in the draft "
            f"(e.g. {only_draft[:3]}), {len(remapped)} with different ids (e.g. {remapped[:3]})"
        )
    for name in ("bos_token_id", "eos_token_id"):
        t, d = getattr(target, name), getattr(draft, name)
        if t != d:
            problems.append(f"{name} {d} (draft) != {t} (target)")
    if problems:
        raise IncompatibleDraftError(
            "draft model is incompatible with the target: " + "; ".join(problems)
        )
