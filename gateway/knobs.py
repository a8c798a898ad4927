"""The engine's knobs as the gateway's settings and ``specgate serve``'s flags carry them.

Each knob is declared once, by its field of ``engine.config.EngineConfig`` or
``SpeculativeConfig``: type, default, bounds and description. The setting of the same knob is
that field (``knob``), and a flag's help is its description (``knob_help``). The one thing a
setting may add is ``unset``: the setting then defaults to None, which means what the
sentence says (take the engine's default, or a ``--speculative-config``'s, or the demo
pair), and the sentence is appended to the description.

Light on purpose (pydantic and ``engine.config`` only), so that the CLI can build its help
from it without loading the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, PlainValidator, WrapValidator
from pydantic.fields import FieldInfo

from engine.config import EngineConfig, SpeculativeConfig


@dataclass(frozen=True)
class Knob:
    """A setting that is ``owner``'s field ``field``; ``unset`` is what its None means where
    the engine's field has another default (the setting's default is then None)."""

    owner: type[BaseModel]
    field: str
    unset: str | None = None

    @property
    def declared(self) -> FieldInfo:
        return self.owner.model_fields[self.field]

    @property
    def description(self) -> str:
        described = self.declared.description or ""
        return f"{described} Unset: {self.unset}" if self.unset else described


_ENGINE, _SPECULATIVE = EngineConfig, SpeculativeConfig

# Setting name -> the engine field it sets. The names are the settings', YAML keys' and
# ``SPECGATE_*`` variables'; most are the engine's own, the fallback rules carry a prefix.
KNOBS: dict[str, Knob] = {
    "target": Knob(_ENGINE, "target", unset="the demo pair (specgate models build-demo)."),
    "draft": Knob(_ENGINE, "draft"),
    "heads": Knob(_ENGINE, "heads"),
    "method": Knob(
        _SPECULATIVE,
        "method",
        unset="the method of the artefact given (a draft: 'draft'), else 'none'.",
    ),
    "num_speculative_tokens": Knob(_SPECULATIVE, "num_speculative_tokens"),
    "max_speculative_tokens": Knob(_SPECULATIVE, "max_speculative_tokens"),
    "prompt_lookup_min": Knob(
        _SPECULATIVE, "prompt_lookup_min", unset="--speculative-config's, else 1."
    ),
    "prompt_lookup_max": Knob(
        _SPECULATIVE, "prompt_lookup_max", unset="--speculative-config's, else 4."
    ),
    "draft_confidence_threshold": Knob(_SPECULATIVE, "draft_confidence_threshold"),
    "acceptance_threshold": Knob(_SPECULATIVE, "acceptance_threshold"),
    "fallback_window_tokens": Knob(_SPECULATIVE, "window_tokens"),
    "fallback_probe_interval": Knob(_SPECULATIVE, "probe_interval_requests"),
    "disable_by_queue_depth": Knob(_SPECULATIVE, "disable_by_queue_depth"),
    "fallback_min_speedup": Knob(_SPECULATIVE, "min_speedup"),
    "acceptance_thresholds": Knob(_SPECULATIVE, "acceptance_thresholds"),
    "dtype": Knob(_ENGINE, "dtype"),
    "device": Knob(_ENGINE, "device"),
    "max_queue": Knob(_ENGINE, "max_queue"),
    "cpu_threads": Knob(_ENGINE, "cpu_threads"),
    "max_num_seqs": Knob(_ENGINE, "max_num_seqs"),
    "max_num_batched_tokens": Knob(_ENGINE, "max_num_batched_tokens"),
    "long_prefill_token_threshold": Knob(_ENGINE, "long_prefill_token_threshold"),
    "max_prefill_chunk_seconds": Knob(_ENGINE, "max_prefill_chunk_seconds"),
    "batch_invariant": Knob(_ENGINE, "batch_invariant"),
    "max_kv_tokens": Knob(_ENGINE, "max_kv_tokens"),
    "served_model_name": Knob(_ENGINE, "served_model_name"),
    "translate_draft_tokens": Knob(_ENGINE, "translate_draft_tokens"),
    "tool_call_parser": Knob(_ENGINE, "tool_call_parser"),
}

# EngineConfig fields that are no one setting: the speculative block is assembled from the
# speculative knobs and ``speculative_config`` (vLLM's JSON).
NOT_KNOBS = frozenset({"speculative"})


_TYPE_VALIDATORS = (AfterValidator, BeforeValidator, PlainValidator, WrapValidator)


def knob(name: str) -> Any:
    """The settings field of knob ``name``: the engine's field (default, bounds,
    description), defaulting to None where the knob says what unset means. The setting's
    annotation is the engine field's (``| None`` where it may be unset); validators that
    type brings (a registered method's check) stay with the type, not the field."""
    entry = KNOBS[name]
    field = FieldInfo.merge_field_infos(entry.declared)
    field.metadata = [m for m in field.metadata if not isinstance(m, _TYPE_VALIDATORS)]
    if entry.unset is not None:
        field = FieldInfo.merge_field_infos(
            field, default=None, default_factory=None, description=entry.description
        )
    return field


def knob_help(name: str) -> str:
    """A flag's help: the knob's description."""
    return KNOBS[name].description
