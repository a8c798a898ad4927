"""Engine configuration, in Specgate's own terms and in vLLM's ``--speculative-config`` terms."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.api.types import MAX_SPECULATIVE_TOKENS, Method
from engine.speculation import methods
from engine.speculation.methods import RegisteredMethod

DType = Literal["auto", "bfloat16", "float16", "float32"]
ToolCallParser = Literal["hermes", "llama3_json", "mistral"]


class SpeculativeConfig(BaseModel):
    """How the engine speculates by default, and when it stops speculating.

    Besides the fields below it holds each registered method's own options (its
    ``MethodSpec.options``, e.g. Medusa's ``medusa_tree``), flat beside them and defaulted,
    so the JSON form names them as it names every other key; ``options_for`` reads them back
    as the method's model. Any other key is refused.
    """

    model_config = ConfigDict(extra="allow")

    method: RegisteredMethod = Field(
        default="none",
        description="Default speculation: none or a registered method "
        "(engine.speculation.methods).",
    )
    num_speculative_tokens: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SPECULATIVE_TOKENS,
        description="Fixed K; None lets the engine adapt K per request.",
    )
    max_speculative_tokens: int = Field(
        default=MAX_SPECULATIVE_TOKENS,
        ge=1,
        le=MAX_SPECULATIVE_TOKENS,
        description="Upper bound of adaptive K.",
    )
    prompt_lookup_min: int = Field(
        default=1, ge=1, description="Shortest n-gram that n-gram lookup matches (vLLM's name)."
    )
    prompt_lookup_max: int = Field(
        default=4, ge=1, description="Longest n-gram that n-gram lookup matches (vLLM's name)."
    )
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

    acceptance_thresholds: dict[RegisteredMethod, float] = Field(
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
        return self.acceptance_threshold if method in methods.model_based() else None

    def options_for(self, method: Method) -> BaseModel | None:
        """The method's own options (its ``MethodSpec.options`` model), None if it has none."""
        return methods.options_of(method, self.__pydantic_extra__ or {})

    @model_validator(mode="after")
    def _method_options(self) -> SpeculativeConfig:
        extra = self.__pydantic_extra__ if self.__pydantic_extra__ is not None else {}
        unknown = sorted(key for key in extra if methods.option_owner(key) is None)
        if unknown:
            raise ValueError(f"unknown speculative configuration keys: {', '.join(unknown)}")
        for spec in methods.methods().values():
            if spec.options is not None:
                given = {k: v for k, v in extra.items() if k in spec.options.model_fields}
                extra.update(spec.options.model_validate(given).model_dump(mode="json"))
        self.__pydantic_extra__ = extra
        return self

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

    target: Path = Field(description="Target model directory.")
    draft: Path | None = Field(default=None, description="Draft model directory.")
    heads: Path | None = Field(
        default=None,
        description="Medusa or EAGLE heads trained on the target (specgate heads train).",
    )
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    dtype: DType = Field(
        default="auto",
        description="The dtype the target is served in: auto, bfloat16, float16 or float32 "
        "(auto: bfloat16 on CUDA; on CPU the one measured to decode faster).",
    )
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
    long_prefill_token_threshold: int = Field(
        default=128,
        ge=1,
        description="Most prompt tokens one request prefills per step (vLLM's name): a long "
        "prompt is cut into chunks of this size, and a chunk that does not finish its prompt "
        "runs after the step's decode pass, so a short request arriving behind it waits at "
        "most one such chunk for its first token.",
    )
    max_prefill_chunk_seconds: float | None = Field(
        default=0.25,
        gt=0,
        description="Most seconds one prefill chunk pass should take: a chunk is cut below "
        "long_prefill_token_threshold where the measured cost per prompt token would make "
        "it take longer, so a request arriving behind a long prompt waits about this long "
        "for the chunk in flight on any machine (at least 16 tokens a chunk). None: chunks "
        "are bounded in tokens only.",
    )
    batch_invariant: bool = Field(
        default=False,
        description="Run each sequence of a batched step in a pass of its own (target and "
        "draft), so that its logits, and so its greedy output, do not depend on what else is "
        "in the batch; costs the throughput that shared passes bring.",
    )
    max_kv_tokens: int | None = Field(
        default=None,
        ge=1,
        description="KV budget in cached positions over all slots: a request is admitted "
        "while the running requests' reservations (prompt + max_tokens + one step's rows "
        "each; every slot's cache grows on its own up to its reservation) and its own fit. "
        "None: no bound beyond max_num_seqs x the context window.",
    )
    served_model_name: str | None = Field(
        default=None,
        description="The model id clients send (their `model`); None: the target directory's name.",
    )
    translate_draft_tokens: bool = Field(
        default=False,
        description="Accept a draft whose tokenizer differs from the target's: its output is "
        "re-tokenized into the target's ids and proposed as a deterministic guess (Hugging "
        "Face's universal assisted decoding). Off: such a draft is refused at load.",
    )
    tool_call_parser: ToolCallParser | None = Field(
        default=None,
        description="How tool calls are read from the output (vLLM's --tool-call-parser); "
        "None: chosen from the chat template.",
    )

    @model_validator(mode="after")
    def _artefact_given(self) -> EngineConfig:
        method = self.speculative.method
        artefact = methods.spec(method).artefact
        if artefact is not None and getattr(self, artefact.config_field) is None:
            raise ValueError(
                f"speculative.method {method!r} needs a {artefact.description} directory"
            )
        return self


def speculative_config_from_vllm(
    text_or_obj: str | dict[str, Any],
) -> tuple[SpeculativeConfig, Path | None]:
    """Read vLLM's ``--speculative-config`` JSON; returns our config and its ``model`` path
    (the directory of the method's artefact: a draft model, heads).

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
    spec = methods.from_vllm_name(str(method_name))
    if spec is None:
        raise ValueError(
            f"--speculative-config method {method_name!r} is not supported; "
            f"use one of {', '.join(sorted(methods.vllm_names()))}"
        )
    fields: dict[str, Any] = {"method": spec.name}
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        if key in obj:
            fields[key] = obj[key]
    if "prompt_lookup_max" in fields and "prompt_lookup_min" not in fields:
        fields["prompt_lookup_min"] = min(1, fields["prompt_lookup_max"])
    if "disable_by_batch_size" in obj:
        fields["disable_by_queue_depth"] = obj["disable_by_batch_size"]
    loads = spec.artefact is not None
    model = Path(obj["model"]) if loads and obj.get("model") else None
    if loads and model is None:
        raise ValueError(f"--speculative-config method {method_name!r} needs 'model'")
    return SpeculativeConfig(**fields), model
