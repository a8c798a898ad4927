"""Engine configuration, in Specgate's own terms and in vLLM's ``--speculative-config`` terms."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.types import MODEL_BASED_METHODS, Method

DType = Literal["auto", "bfloat16", "float16", "float32"]

# vLLM's method names, mapped onto ours.
_VLLM_METHODS: dict[str, Method] = {
    "ngram": "ngram",
    "draft_model": "draft",
    "draft": "draft",
    "medusa": "medusa",
    "eagle": "eagle",
}
# Methods whose ``model`` in vLLM's config is an artefact directory (a draft model, heads).
_VLLM_MODEL_METHODS: frozenset[Method] = frozenset({"draft", "medusa", "eagle"})


class SpeculativeConfig(BaseModel):
    """How the engine speculates by default, and when it stops speculating."""

    model_config = ConfigDict(extra="forbid")

    method: Method = "none"
    num_speculative_tokens: int | None = Field(
        default=None, ge=1, le=16, description="Fixed K; None lets the engine adapt K per request."
    )
    max_speculative_tokens: int = Field(default=16, ge=1, le=16)
    prompt_lookup_min: int = Field(default=1, ge=1)
    prompt_lookup_max: int = Field(default=4, ge=1)
    draft_confidence_threshold: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="With adaptive K, the draft stops proposing after a token it gives a "
        "probability below this (0 turns it off).",
    )
    acceptance_threshold: float = Field(
        default=0.6,
        ge=0.0,
        le=1.0,
        description="Below this rolling acceptance rate a model-based proposer (a draft "
        "model) is switched off; other methods only by acceptance_thresholds.",
    )
    window_tokens: int = Field(default=256, ge=8, description="Draft tokens in the rolling window.")
    probe_interval_requests: int = Field(
        default=8, ge=1, description="While switched off, every Nth request still speculates."
    )
    disable_by_queue_depth: int | None = Field(
        default=None, ge=1, description="Decode plainly while at least this many requests wait."
    )

    medusa_tree: list[list[int]] | None = Field(
        default=None,
        description="Medusa's static tree as paths of top-k ranks, e.g. [[0], [1], [0, 0]] "
        "(each after its parent); None: the built-in tree (engine.proposers.medusa).",
    )
    num_steps: int = Field(
        default=5, ge=1, le=16, description="EAGLE-2: depth levels the draft tree grows "
        "(SGLang's speculative_num_steps)."
    )
    eagle_topk: int = Field(
        default=4, ge=1, le=16, description="EAGLE-2: children per expanded node, and nodes "
        "expanded per level (SGLang's speculative_eagle_topk)."
    )
    num_draft_tokens: int = Field(
        default=16, ge=1, le=16, description="EAGLE-2: nodes kept after re-ranking by "
        "cumulative draft probability (SGLang's speculative_num_draft_tokens); k, fixed or "
        "adaptive, bounds it further."
    )
    acceptance_thresholds: dict[Method, float] = Field(
        default_factory=dict,
        description="Acceptance threshold per method, overriding acceptance_threshold (e.g. "
        '{"ngram": 0.3}).',
    )
    min_speedup: float = Field(
        default=1.0,
        ge=0.0,
        description="A method whose estimated speedup over plain decoding (from acceptance, "
        "k and measured pass costs) stays below this over the window is switched off; 0 "
        "turns the rule off.",
    )

    def acceptance_threshold_for(self, method: Method) -> float | None:
        """The method's acceptance threshold: its own, else the default for model-based
        proposers, else none (n-gram lookup is judged on its estimated speedup alone)."""
        if method in self.acceptance_thresholds:
            return self.acceptance_thresholds[method]
        return self.acceptance_threshold if method in MODEL_BASED_METHODS else None

    @model_validator(mode="after")
    def _thresholds_in_range(self) -> SpeculativeConfig:
        bad = {m: t for m, t in self.acceptance_thresholds.items() if not 0.0 <= t <= 1.0}
        if bad:
            raise ValueError(f"acceptance_thresholds must lie in [0, 1]: {bad}")
        return self

    @model_validator(mode="after")
    def _lookup_bounds(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: Path
    draft: Path | None = None
    heads: Path | None = Field(
        default=None,
        description="Medusa or EAGLE heads trained on the target (specgate heads train).",
    )
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    dtype: DType = "auto"
    device: str | None = Field(
        default=None, description="cuda, cpu, ...; None picks CUDA if present."
    )
    max_queue: int = Field(
        default=64, ge=1, description="Requests waiting beyond this get QueueFullError."
    )
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch CPU threads (process-wide); None keeps torch's choice. On shared "
        "cores one thread keeps multi-token verification passes cheap.",
    )
    max_num_seqs: int = Field(
        default=16,
        ge=1,
        le=256,
        description="Sequences decoded together in one batch (vLLM's name).",
    )
    max_num_batched_tokens: int = Field(
        default=512,
        ge=16,
        description="Rows per step: the decoding sequences' rows plus prompt chunks prefilled "
        "beside them (vLLM's name); a longer prompt is prefilled over several steps.",
    )
    max_kv_tokens: int | None = Field(
        default=None,
        ge=1,
        description="KV budget in cached positions over all slots; every slot is padded to "
        "the longest reservation (prompt + max_tokens) in the batch. None: no bound beyond "
        "max_num_seqs x the context window.",
    )
    served_model_name: str | None = None
    translate_draft_tokens: bool = Field(
        default=False,
        description="Accept a draft whose tokenizer differs from the target's: its output is "
        "re-tokenized into the target's ids and proposed as a deterministic guess (Hugging "
        "Face's universal assisted decoding). Off: such a draft is refused at load.",
    )
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = Field(
        default=None,
        description="How tool calls are read from the output (vLLM's --tool-call-parser); "
        "None: chosen from the chat template.",
    )

    @model_validator(mode="after")
    def _draft_needed(self) -> EngineConfig:
        if self.speculative.method == "draft" and self.draft is None:
            raise ValueError("speculative.method 'draft' needs a draft model directory")
        if self.speculative.method in ("medusa", "eagle") and self.heads is None:
            method = self.speculative.method
            raise ValueError(f"speculative.method {method!r} needs a heads directory")
        return self


def speculative_config_from_vllm(
    text_or_obj: str | dict[str, Any],
) -> tuple[SpeculativeConfig, Path | None]:
    """Read vLLM's ``--speculative-config`` JSON; returns our config and its ``model`` path
    (the draft model, or for ``medusa`` and ``eagle`` the heads directory).

    Only the keys Specgate implements are accepted; anything else is an error that names it,
    so that an operator never believes a setting was carried over when it was not.
    """
    obj: dict[str, Any] = (
        json.loads(text_or_obj) if isinstance(text_or_obj, str) else dict(text_or_obj)
    )
    known = {
        "method",
        "model",
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "disable_by_batch_size",
    }
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValueError(f"unsupported --speculative-config keys: {', '.join(unknown)}")
    method_name = obj.get("method")
    if method_name is None:
        method_name = "draft_model" if obj.get("model") else "ngram"
    if method_name not in _VLLM_METHODS:
        raise ValueError(
            f"--speculative-config method {method_name!r} is not supported; "
            f"use one of {', '.join(sorted(_VLLM_METHODS))}"
        )
    method = _VLLM_METHODS[method_name]
    fields: dict[str, Any] = {"method": method}
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        if key in obj:
            fields[key] = obj[key]
    if "prompt_lookup_max" in fields and "prompt_lookup_min" not in fields:
        fields["prompt_lookup_min"] = min(1, fields["prompt_lookup_max"])
    if "disable_by_batch_size" in obj:
        fields["disable_by_queue_depth"] = obj["disable_by_batch_size"]
    model = Path(obj["model"]) if method in _VLLM_MODEL_METHODS and obj.get("model") else None
    if method in _VLLM_MODEL_METHODS and model is None:
        raise ValueError(f"--speculative-config method {method_name!r} needs 'model'")
    return SpeculativeConfig(**fields), model
