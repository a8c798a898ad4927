"""Quoting documents: functions from the training files, followed by a verbatim or renamed copy.

Instruction-tuned models repeat and lightly edit code they were given (quote this function,
rename that one), and that is the workload where n-gram prompt lookup pays. A model trained
only on raw source files barely copies at this size (the first float32 demo target repeated
its prompt 42% of the time), so the demo build mixes such documents into the target's
training stream, in the two templates the benchmark's ``quoting`` set uses. They are cut
from training files only; the benchmark's prompts come from held-out files.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap
from collections.abc import Iterable, Iterator

from engine.demo.corpus import SourceFile

MIN_LINES, MAX_LINES = 4, 40
QUOTE_HEADER = "\n\n\n# The function above, quoted verbatim:\n"
RENAME_HEADER = "\n\n\n# The same function, renamed to {name}:\n"


def functions(source: SourceFile) -> Iterator[tuple[str, str]]:
    """``(name, dedented source)`` of every function of a readable length in the file."""
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


def quoting_document(name: str, code: str, rename: bool) -> str:
    if not rename:
        return code + QUOTE_HEADER + code
    new_name = f"{name}_v2"
    renamed = re.sub(rf"\b{re.escape(name)}\b", new_name, code)
    return code + RENAME_HEADER.format(name=new_name) + renamed


def quoting_documents(files: Iterable[SourceFile], chars: int, seed: int) -> list[str]:
    """About ``chars`` characters of quoting documents, from functions chosen with ``seed``."""
    candidates = [fn for source in files for fn in functions(source)]
    rng = random.Random(seed)
    rng.shuffle(candidates)
    documents: list[str] = []
    total = 0
    for index, (name, code) in enumerate(candidates):
        if total >= chars:
            break
        document = quoting_document(name, code, rename=index % 2 == 1)
        documents.append(document)
        total += len(document)
    return documents
