"""Draft heads that speculate from the target's own hidden states (Medusa, EAGLE)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from engine.api.types import EngineError


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
