"""Quoting documents for the demo target's training stream."""

from __future__ import annotations

from engine.demo.corpus import SourceFile
from engine.demo.quoting import (
    QUOTE_HEADER,
    functions,
    quoting_document,
    quoting_documents,
)

SOURCE = SourceFile(
    "example.py",
    '''import os


def short():
    return 1


def helper(path):
    """Join twice."""
    full = os.path.join(path, path)
    return helper(full) if len(full) < 3 else full


class Box:
    def size(self, other):
        total = 0
        for item in other:
            total += item
        return total

    @property
    def decorated(self):
        a = 1
        b = 2
        return a + b
''',
)


def test_functions_are_dedented_and_filtered_by_length_and_decorators() -> None:
    found = dict(functions(SOURCE))
    assert set(found) == {"helper", "size"}
    assert found["size"].startswith("def size(self, other):\n    total = 0")
    assert found["size"].endswith("return total")


def test_unparsable_files_give_no_functions() -> None:
    assert list(functions(SourceFile("broken.py", "def f(:\n"))) == []


def test_verbatim_quote_repeats_the_function_after_the_header() -> None:
    code = dict(functions(SOURCE))["helper"]
    assert quoting_document("helper", code, rename=False) == code + QUOTE_HEADER + code


def test_rename_replaces_whole_words_only() -> None:
    code = dict(functions(SOURCE))["helper"]
    document = quoting_document("helper", code, rename=True)
    original, renamed = document.split("# The same function, renamed to helper_v2:\n")
    assert original.rstrip("\n") == code
    assert renamed.startswith("def helper_v2(path):")
    assert "return helper_v2(full)" in renamed
    assert renamed.count("helper_v2") == 2


def test_documents_alternate_templates_and_stop_near_the_budget() -> None:
    files = [SourceFile(f"m{i}.py", SOURCE.text) for i in range(20)]
    documents = quoting_documents(files, chars=600, seed=7)
    assert 600 <= sum(len(d) for d in documents) < 600 + max(len(d) for d in documents)
    assert QUOTE_HEADER in documents[0] and "renamed to" in documents[1]
    assert documents == quoting_documents(files, chars=600, seed=7)
