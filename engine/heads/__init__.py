"""Draft heads that speculate from the target's own hidden states (Medusa, EAGLE)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal


def heads_method(heads_dir: Path) -> Literal["medusa", "eagle"]:
    """Which method a heads directory serves, from its config alone (no torch): an EAGLE
    draft in vLLM's ``speculators`` format, else Medusa heads (whose loader names what is
    missing)."""
    config = heads_dir / "config.json"
    raw = json.loads(config.read_text()) if config.is_file() else None
    if isinstance(raw, dict) and raw.get("speculators_model_type") == "eagle":
        return "eagle"
    return "medusa"
