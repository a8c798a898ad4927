"""Chat requests whose answers the draft is distilled on, cut from the standard library's
training files (``engine.demo.corpus``), in the four kinds the benchmark measures: questions,
code completion, quoting or editing a given text, and JSON extraction.

The benchmark's prompts (``bench/prompts``) are written apart from these and take their code
from held-out files only, so the draft never sees them.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap
from collections.abc import Iterable, Iterator

from engine.demo.corpus import SourceFile

Messages = list[dict[str, str]]
MIN_LINES, MAX_LINES = 4, 16

_QUESTIONS = (
    "What does the Python function `{name}` below do? Explain briefly.\n\n{code}",
    "Write a short docstring for this function.\n\n{code}",
    "Is there a bug in this code? Answer in two or three sentences.\n\n{code}",
    "Explain what the Python module `{module}` is for, in a few sentences.",
    "Give one example of using the Python module `{module}`.",
)
_COMPLETIONS = (
    "Complete this Python function.\n\n{head}",
    "Finish the code:\n\n```python\n{head}\n```",
)
_EDITS = (
    "Repeat this function verbatim:\n\n{code}",
    "Rename the function to `{name}_v2` and change nothing else:\n\n{code}",
    "Add type hints to this function and return the whole function.\n\n{code}",
    "Rewrite this function with a comment on every line.\n\n{code}",
)
_EXTRACTIONS = (
    "Extract the function name, its parameters and whether it returns a value, as JSON with "
    'the keys "name", "parameters" and "returns".\n\n{code}',
    "List every name this function calls, as a JSON array of strings.\n\n{code}",
)


def functions(source: SourceFile) -> Iterator[tuple[str, str]]:
    """``(name, dedented source)`` of every undecorated function of a readable length."""
    try:
        tree = ast.parse(source.text)
    except (SyntaxError, ValueError):
        return
    lines = source.text.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.decorator_list:
            continue
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        if MIN_LINES <= length <= MAX_LINES:
            code = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
            yield node.name, code.rstrip("\n")


def _module_name(relative_path: str) -> str:
    return re.sub(r"(/__init__)?\.py$", "", relative_path).replace("/", ".")


def distillation_prompts(files: Iterable[SourceFile], count: int, seed: int) -> list[Messages]:
    """``count`` single-turn chats, the four kinds in turn, from functions chosen with ``seed``."""
    rng = random.Random(seed)
    candidates = [
        (_module_name(source.relative_path), name, code)
        for source in files
        for name, code in functions(source)
    ]
    rng.shuffle(candidates)
    kinds = (_QUESTIONS, _COMPLETIONS, _EDITS, _EXTRACTIONS)
    chats: list[Messages] = []
    for index, (module, name, code) in enumerate(candidates[:count]):
        template = rng.choice(kinds[index % len(kinds)])
        lines = code.splitlines()
        head = "\n".join(lines[: max(2, len(lines) // 3)])
        content = template.format(module=module, name=name, code=code, head=head)
        chats.append([{"role": "user", "content": content}])
    return chats
