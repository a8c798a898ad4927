"""Chat requests whose answers the draft is distilled on, in the four kinds the benchmark
measures: questions (everyday topics, and about code), code completion, quoting or editing a
given text, and JSON extraction (from code, and from short generated records). The code comes
from the standard library's training files (``engine.training.demo.corpus``).

The benchmark's prompts (``bench/prompts``) are written apart from these and take their code
from held-out files only, so the draft never sees them.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from engine.training.demo.corpus import SourceFile

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
    "This function from `{path}` is unfinished. Complete it.\n\n```python\n{head}\n```",
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
    "How does {topic} work? Keep it short.",
    "Why does {topic} matter? Explain it simply.",
    "Summarise what a beginner should know about {topic}.",
    "What is the history of {topic}, in a few sentences?",
    "Give me {count} tips for {activity}.",
    "What are the most common mistakes people make when {activity}?",
    "How should I get started with {activity}?",
    "What should I bring when {activity}?",
    "Write a short, {tone} email {purpose}.",
    "Write a {tone} message to a colleague {purpose}.",
    "Suggest a name for {business} in {city} and explain your choice.",
    "Suggest {count} names for {business} and say why each works.",
    "What is the difference between {pair}? Answer in a short paragraph.",
    "Compare {pair} in a few sentences.",
    "Plan a simple {meal} for {people} people.",
    "Describe a typical day of a {job}.",
    "What skills does a {job} need?",
)
# Fillers for the chat templates; the benchmark's own chat questions use none of them.
_ACTIVITIES = (
    "learning to cook", "studying for an exam", "starting a vegetable garden",
    "training for a 10 km run", "keeping a journal", "moving to a new city",
    "working from home", "learning to draw", "taking better photos", "saving for a holiday",
    "reading more books", "giving feedback", "writing clear documentation", "debugging code",
    "learning to swim", "preparing for a job interview", "organising a small event",
    "travelling with children", "cycling to work", "looking after a dog",
)
_TONES = ("polite", "friendly", "formal", "brief", "warm", "professional")
_PURPOSES = (
    "asking for a deadline extension", "thanking a team for their help",
    "inviting friends to a birthday dinner", "asking a landlord to fix the heating",
    "apologising for a late reply", "requesting a day off", "introducing yourself to a new team",
    "following up after an interview", "cancelling a dentist appointment",
    "asking a neighbour to keep the noise down", "welcoming a new colleague",
)
_BUSINESSES = (
    "a coffee shop", "a bicycle repair shop", "a bookshop", "a flower shop", "a yoga studio",
    "a pizza restaurant", "a hair salon", "a software consultancy", "a pet shop",
    "an ice cream parlour",
)
_PAIRS = (
    "weather and climate", "a virus and a bacterium", "a list and a tuple in Python",
    "RAM and storage", "TCP and UDP", "a loan and a mortgage", "speed and velocity",
    "an alligator and a crocodile", "baking soda and baking powder", "a simile and a metaphor",
    "HTTP and HTTPS", "a compiler and an interpreter", "stocks and bonds", "tea and coffee",
    "a lake and a pond", "machine learning and statistics",
)
_MEALS = ("breakfast", "lunch", "dinner", "picnic", "vegetarian dinner", "birthday brunch")
_JOBS = (
    "nurse", "software developer", "teacher", "chef", "farmer", "pilot", "librarian",
    "electrician", "journalist", "architect", "firefighter", "data analyst",
)


def _chat(rng: random.Random) -> str:
    """One everyday chat request, a template filled from the lists above."""
    return rng.choice(_CHATS).format(
        topic=rng.choice(_TOPICS), activity=rng.choice(_ACTIVITIES), tone=rng.choice(_TONES),
        purpose=rng.choice(_PURPOSES), business=rng.choice(_BUSINESSES),
        city=rng.choice(_CITIES), pair=rng.choice(_PAIRS), meal=rng.choice(_MEALS),
        people=rng.randint(2, 8), job=rng.choice(_JOBS), count=rng.choice(("three", "five")),
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


class DistillationPrompt(NamedTuple):
    kind: str  # "chat", "code", "question", "edit" or "json": what the held-out figures split by
    messages: Messages


# Everyday chat is the most varied kind, so it gets the largest share; code completion next.
_KIND_CYCLE = ("chat", "code", "chat", "question", "edit", "chat", "code", "json")


def distillation_prompts(
    files: Iterable[SourceFile], count: int, seed: int
) -> list[DistillationPrompt]:
    """``count`` single-turn chats, the kinds in ``_KIND_CYCLE`` order, from functions (for
    the kinds that quote code) chosen with ``seed``."""
    rng = random.Random(seed)
    candidates = [
        (_module_name(source.relative_path), source.relative_path, name, code)
        for source in files
        for name, code in functions(source)
    ]
    rng.shuffle(candidates)
    chats: list[DistillationPrompt] = []
    for index, (module, path, name, code) in enumerate(candidates[:count]):
        kind = _KIND_CYCLE[index % len(_KIND_CYCLE)]
        lines = code.splitlines()
        head = "\n".join(lines[: max(2, len(lines) // 3)])
        if kind == "chat":
            content = _chat(rng)
        elif kind == "json" and index % 2:
            text, keys = _record(rng)
            content = f"Return the {keys} in this text as a JSON object.\n\n{text}"
        else:
            templates = {
                "code": _COMPLETIONS, "question": _QUESTIONS, "edit": _EDITS, "json": _EXTRACTIONS,
            }[kind]
            content = rng.choice(templates).format(
                module=module, path=path, name=name, code=code, head=head
            )
        chats.append(DistillationPrompt(kind, [{"role": "user", "content": content}]))
    return chats
