"""Where the demo model pair lives when no directory is given."""

from __future__ import annotations

import os
from pathlib import Path


def default_demo_dir() -> Path:
    """``$XDG_CACHE_HOME/specgate/demo``, or ``~/.cache/specgate/demo`` when that is unset."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "specgate" / "demo"
