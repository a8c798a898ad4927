"""Quoting chats: a user gives a function from the training files and asks for it verbatim or
renamed; the assistant answers with the copy.

Instruction-tuned models repeat and lightly edit code they were given, and that is the
workload where n-gram prompt lookup pays. A model trained only on raw source files barely
copies at this size, so the demo build mixes such chats into the training stream, in the
chat template and with the two instructions of the benchmark's ``quoting`` set. Being chats,
they leave plain code completion alone (the same copies written as raw code comments taught
the target to follow every function with a copy). They are cut from training files only; the
benchmark's prompts come from held-out files.

Chats alone do not teach the target to copy at this size and budget: on an 8-layer proxy of
it, quoting shares of 0.15 to 0.6 and auxiliary losses on attention patterns all left it
predicting under a quarter of a held-out quote. What makes it copy is the induction circuit
wired into it before training (``induction.py``); the chats give it the requests' format.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap
from collections.abc import Iterable, Iterator

from engine.demo.corpus import SourceFile

MIN_LINES, MAX_LINES = 4, 40
QUOTE_INSTRUCTION = "Repeat this function verbatim:\n\n"
RENAME_INSTRUCTION = "Rename this function to {name}:\n\n"


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


def quoting_request(name: str, code: str, rename: bool) -> tuple[str, str]:
    """The user's instruction and the answer: the function verbatim, or renamed throughout."""
    if not rename:
        return QUOTE_INSTRUCTION + code, code
    new_name = f"{name}_v2"
    renamed = re.sub(rf"\b{re.escape(name)}\b", new_name, code)
    return RENAME_INSTRUCTION.format(name=new_name) + code, renamed


def quoting_conversations(
    files: Iterable[SourceFile], chars: int, seed: int
) -> list[list[dict[str, str]]]:
    """About ``chars`` characters of quoting chats, from functions chosen with ``seed``,
    alternating verbatim quotes and renames."""
    candidates = [fn for source in files for fn in functions(source)]
    rng = random.Random(seed)
    rng.shuffle(candidates)
    conversations: list[list[dict[str, str]]] = []
    total = 0
    for index, (name, code) in enumerate(candidates):
        if total >= chars:
            break
        request, answer = quoting_request(name, code, rename=index % 2 == 1)
        conversations.append(
            [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]
        )
        total += len(request) + len(answer)
    return conversations
