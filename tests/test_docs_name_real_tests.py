"""Every guarantee in the README and ``docs/`` names the test that holds it: each test file
and test function named there exists, so a renamed or deleted test cannot leave a promise
pointing at nothing."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
FILE_AND_TEST = re.compile(r"(test_\w+\.py)(?:::\s*(test_\w+))?")
QUOTED_TEST = re.compile(r"`(test_\w+)")


def defined_tests() -> dict[str, set[str]]:
    """Test function name -> the test files that define it."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        for name in re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M):
            found.setdefault(name, set()).add(path.name)
    return found


def dangling_references() -> list[str]:
    defined = defined_tests()
    files = {path.name for path in (ROOT / "tests").rglob("test_*.py")}
    dangling: list[str] = []
    for document in DOCUMENTS:
        text = document.read_text()
        for file, function in FILE_AND_TEST.findall(text):
            if file not in files:
                dangling.append(f"{document.name}: {file}")
            elif function and file not in defined.get(function, set()):
                dangling.append(f"{document.name}: {file}::{function}")
        for name in QUOTED_TEST.findall(text):
            if name not in defined and f"{name}.py" not in files:
                dangling.append(f"{document.name}: {name}")
    return dangling


def test_every_test_the_docs_name_exists() -> None:
    assert dangling_references() == []


def test_a_renamed_test_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    document = tmp_path / "promise.md"
    document.write_text(
        "Held by `test_audit_tail.py::test_no_such_test` and `test_no_such_function`.\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "DOCUMENTS", [document])
    assert dangling_references() == [
        "promise.md: test_audit_tail.py::test_no_such_test",
        "promise.md: test_no_such_function",
    ]
