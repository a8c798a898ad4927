"""Draft heads that speculate from the target's own hidden states (Medusa, EAGLE)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from engine.types import EngineError


class HeadsMismatchError(EngineError):
    """Heads made for another target (its version, hidden size or vocabulary), or of another
    kind than the method asks for."""


def heads_method(heads_dir: Path) -> Literal["medusa", "eagle"]:
    """Which method a heads directory serves, from its config alone (no torch): an EAGLE
    draft in vLLM's ``speculators`` format, else Medusa heads (whose loader names what is
    missing)."""
    config = heads_dir / "config.json"
    raw = json.loads(config.read_text()) if config.is_file() else None
    if isinstance(raw, dict) and raw.get("speculators_model_type") == "eagle":
        return "eagle"
    return "medusa"


def check_heads_kind(method: Literal["medusa", "eagle"], heads_dir: Path) -> None:
    """Refuse heads of the other kind for ``method``, naming both."""
    held = heads_method(heads_dir)
    if held != method:
        raise HeadsMismatchError(
            f"speculative.method {method!r} needs {method} heads, but {heads_dir} holds "
            f"{held} heads"
        )


def check_heads_fit(
    label: str, heads_dir: Path, trained_on: str | None, sizes: tuple[int, int],
    target: tuple[str, int, int], train_command: str,
) -> None:
    """Refuse heads (``label``: how the message names them) trained on another version of the
    target, or for another hidden size and vocabulary (``sizes``), naming both sides;
    ``target`` is the loaded target's (version, hidden size, vocabulary size)."""
    version, hidden_size, vocab_size = target
    if trained_on is not None and trained_on != version:
        raise HeadsMismatchError(
            f"{label} in {heads_dir} were trained on target version {trained_on}, but the "
            f"target loaded is version {version}; train heads for this target "
            f"({train_command})"
        )
    if sizes != (hidden_size, vocab_size):
        raise HeadsMismatchError(
            f"{label} in {heads_dir} are for hidden size {sizes[0]} and vocabulary "
            f"{sizes[1]}; the target has {hidden_size} and {vocab_size}"
        )
