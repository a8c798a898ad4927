"""The training corpus: the Python standard library's own source files.

Every machine that runs Specgate has them, so the demo pair can be built anywhere without
downloads. Files are held out for evaluation by a hash of their path relative to the
stdlib root, so the split is the same on every interpreter that ships the same file names,
and the benchmark's prompts (taken from held-out files) were never trained on.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Test suites, installed packages and generated data tables (codec maps, pydoc topics) are
# not the Python code the demo should learn to write.
_EXCLUDED_PARTS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
     "encodings", "pydoc_data"}
)
HELD_OUT_MODULUS = 25


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    """About one file in ``HELD_OUT_MODULUS`` is held out, chosen by its path alone."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % HELD_OUT_MODULUS == 0


@dataclass(frozen=True)
class SourceFile:
    relative_path: str
    text: str


@dataclass(frozen=True)
class Corpus:
    train: tuple[SourceFile, ...]
    held_out: tuple[SourceFile, ...]

    @property
    def train_chars(self) -> int:
        return sum(len(f.text) for f in self.train)


def load_corpus(root: Path | None = None, max_files: int | None = None) -> Corpus:
    """Read the stdlib's ``.py`` files in sorted path order; ``max_files`` keeps the first few."""
    base = root or stdlib_root()
    paths = sorted(
        p for p in base.rglob("*.py") if not _EXCLUDED_PARTS.intersection(p.relative_to(base).parts)
    )
    if max_files is not None:
        paths = paths[:max_files]
    train: list[SourceFile] = []
    held_out: list[SourceFile] = []
    for path in paths:
        relative = path.relative_to(base).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (held_out if is_held_out(relative) else train).append(SourceFile(relative, text))
    return Corpus(train=tuple(train), held_out=tuple(held_out))
