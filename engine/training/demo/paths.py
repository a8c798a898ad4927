"""Where the demo model pair and the draft build's cache live when no directory is given."""

from __future__ import annotations

import os
from pathlib import Path


def _specgate_cache() -> Path:
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "specgate"


def default_demo_dir() -> Path:
    """``$XDG_CACHE_HOME/specgate/demo``, or ``~/.cache/specgate/demo`` when that is unset."""
    return _specgate_cache() / "demo"


def default_draft_answers_dir() -> Path:
    """Where the draft build caches the target's answers: ``.../specgate/draft-answers``."""
    return _specgate_cache() / "draft-answers"
