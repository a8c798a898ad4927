"""Chat requests whose answers the draft is distilled on, in the four kinds the benchmark
measures: questions (everyday topics, and about code), code completion, quoting or editing a
given text, and JSON extraction (from code, and from short generated records). The code comes
from the standard library's training files (``engine.demo.corpus``).

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


_TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "glaciers", "the moon's phases",
    "black holes", "vaccines", "the immune system", "sleep", "coffee", "chocolate", "bread",
    "cheese making", "composting", "bees", "wolves", "whales", "forests", "deserts", "rivers",
    "electric cars", "solar panels", "wind turbines", "batteries", "nuclear power",
    "the internet", "email", "passwords", "encryption", "databases", "cloud computing",
    "open source software", "version control", "unit testing", "code review", "recursion",
    "sorting algorithms", "binary search", "linked lists", "regular expressions", "compilers",
    "operating systems", "memory leaks", "APIs", "JSON", "spreadsheets", "budgeting",
    "saving money", "interest rates", "taxes", "insurance", "renting a flat", "job interviews",
    "writing a CV", "public speaking", "time management", "learning a language", "chess",
    "football", "cycling", "running a marathon", "yoga", "gardening", "houseplants",
    "cooking pasta", "baking a cake", "making tea", "travelling by train", "camping",
    "mountain safety", "first aid", "recycling", "climate change", "earthquakes", "maps",
    "the Roman Empire", "the printing press", "the Industrial Revolution", "democracy",
    "libraries", "museums", "music theory", "the piano", "photography", "painting",
    "writing poetry", "short stories", "newspapers", "podcasts", "video games", "robots",
    "artificial intelligence", "smartphones", "3D printing", "airplanes", "rockets",
)
_CHATS = (
    "Explain {topic} to a ten-year-old.",
    "What are the pros and cons of {topic}?",
    "Write a short paragraph about {topic}.",
    "Give me three interesting facts about {topic}.",
    "What is a common misconception about {topic}?",
    "Write a haiku about {topic}.",
)
_FIRST = ("Anna", "Luca", "Sophie", "Noah", "Mia", "Elias", "Lina", "David", "Sara", "Tim")
_LAST = ("Müller", "Schmid", "Keller", "Weber", "Huber", "Meyer", "Frei", "Brunner")
_CITIES = ("Basel", "Chur", "Lucerne", "St. Gallen", "Winterthur", "Thun", "Sion", "Zug")
_THINGS = ("chairs", "lamps", "laptops", "books", "bicycles", "printers", "tables", "phones")


def _record(rng: random.Random) -> tuple[str, str]:
    """A short generated text and the keys to extract from it."""
    name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    city, thing = rng.choice(_CITIES), rng.choice(_THINGS)
    count, price, day = rng.randint(2, 40), rng.randint(5, 900), rng.randint(1, 28)
    texts = (
        (f"{name} ordered {count} {thing} at CHF {price} each, to be delivered to {city} on "
         f"{day} May.", "customer, quantity, item, unit_price_chf, city, delivery_date"),
        (f"Reminder: {name} meets the {city} team on {day} April at {rng.randint(8, 17)}:00 to "
         f"discuss the {thing} budget of CHF {price * 100}.",
         "person, team, date, time, topic, budget_chf"),
        (f"Support ticket {rng.randint(1000, 9999)}: {name} from {city} reports that "
         f"{count} {thing} arrived damaged.", "ticket, customer, city, quantity, item, problem"),
    )
    return rng.choice(texts)


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
    kinds = ("chat", _QUESTIONS, _COMPLETIONS, _EDITS, _EXTRACTIONS, "record")
    chats: list[Messages] = []
    for index, (module, name, code) in enumerate(candidates[:count]):
        kind = kinds[index % len(kinds)]
        if kind == "chat":
            content = rng.choice(_CHATS).format(topic=rng.choice(_TOPICS))
        elif kind == "record":
            text, keys = _record(rng)
            content = f"Return the {keys} in this text as a JSON object.\n\n{text}"
        else:
            lines = code.splitlines()
            head = "\n".join(lines[: max(2, len(lines) // 3)])
            template = rng.choice(kind)
            content = template.format(module=module, name=name, code=code, head=head)
        chats.append([{"role": "user", "content": content}])
    return chats
