"""Quoting chats for the demo's training stream."""

from __future__ import annotations

from engine.demo.corpus import SourceFile
from engine.demo.quoting import (
    QUOTE_INSTRUCTION,
    functions,
    quoting_conversations,
    quoting_request,
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


def test_verbatim_quote_answers_with_the_function_itself() -> None:
    code = dict(functions(SOURCE))["helper"]
    request, answer = quoting_request("helper", code, rename=False)
    assert request == QUOTE_INSTRUCTION + code
    assert answer == code


def test_rename_replaces_whole_words_only() -> None:
    code = dict(functions(SOURCE))["helper"]
    request, answer = quoting_request("helper", code, rename=True)
    assert request == "Rename this function to helper_v2:\n\n" + code
    assert answer.startswith("def helper_v2(path):")
    assert "return helper_v2(full)" in answer
    assert answer.count("helper_v2") == 2
    assert answer.replace("helper_v2", "helper") == code


def test_conversations_alternate_instructions_and_stop_near_the_budget() -> None:
    files = [SourceFile(f"m{i}.py", SOURCE.text) for i in range(20)]
    chats = quoting_conversations(files, chars=1000, seed=7)
    sizes = [len(user["content"]) + len(assistant["content"]) for user, assistant in chats]
    assert 1000 <= sum(sizes) < 1000 + max(sizes)
    assert [m["role"] for m in chats[0]] == ["user", "assistant"]
    assert chats[0][0]["content"].startswith(QUOTE_INSTRUCTION)
    assert chats[1][0]["content"].startswith("Rename this function to ")
    assert chats == quoting_conversations(files, chars=1000, seed=7)
