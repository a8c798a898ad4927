"""Tool calls in a model's output text, by the convention its chat template taught it, read as
the text streams.

Like vLLM's ``--tool-call-parser``: ``hermes`` (``<tool_call>{"name", "arguments"}</tool_call>``
blocks, Qwen, Hermes and the demo), ``llama3_json`` (the whole output one JSON object, or a
list of them, with ``name`` and ``parameters``), ``mistral`` (``[TOOL_CALLS]`` then a JSON list).
The parser is chosen from the template's text unless configured. No torch here: the gateway
uses it.

One set of rules serves both ways of reading: a ``ToolCallReader`` takes the text in pieces and
says at once what is certain (content that cannot be part of a call; a call's name once its
JSON string closes; its arguments' text as each character is checked to continue valid JSON),
and the one-shot parse (``parse_hermes`` and the others) is that reader given the whole text at
once, so a stream reassembles to exactly the non-streamed answer however it is split. What is
said is never taken back, which fixes these rules:

- Content is the text before the first call, less the whitespace just before that call's
  marker. Text after a call (a closing tag, anything else) is not content.
- A call is a JSON object with a ``name`` string; it is committed once its name is read and
  its arguments' value has begun (or the object closed without one). An object that ends
  without a name, or breaks before that, was never a call: its text is content (so output
  without a call is its whole text, unchanged).
- A committed call whose JSON breaks, or that the output ends inside (cut short by
  ``max_tokens``), keeps the arguments read so far; the rest of the text is skipped.
- A call without arguments has ``{}``; arguments given as a JSON string are that string's
  text (given when the string closes).

vLLM's parsers re-parse the partial JSON at each delta and send the difference of its
re-serialised arguments; this reader checks each character once, so the arguments are the
model's own text (no re-serialising) and a reader costs O(length) over a whole output.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

# ---------------------------------------------------------------------------- what a reader says


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = ContentDelta | CallStarted | ArgumentsDelta


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    calls: tuple[ParsedCall, ...]


def assemble(events: Sequence[ToolEvent]) -> ParsedOutput:
    """The message that a reader's events (in order) add up to, as a client reassembles it."""
    content: list[str] = []
    names: list[str] = []
    arguments: list[list[str]] = []
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, CallStarted):
            names.append(event.name)
            arguments.append([])
        else:
            arguments[event.index].append(event.text)
    calls = tuple(ParsedCall(n, "".join(a)) for n, a in zip(names, arguments, strict=True))
    return ParsedOutput("".join(content) or None, calls)


class _Sink:
    """Numbers the calls, keeps at most ``max_calls`` of them, drops content once a call is
    committed, and merges neighbouring pieces of the same kind."""

    def __init__(self, max_calls: int | None) -> None:
        self.max_calls = max_calls
        self.calls = 0
        self._events: list[ToolEvent] = []
        self._run: int | None = None  # the call whose arguments are being gathered; -1: content
        self._pieces: list[str] = []

    def content(self, text: str) -> None:
        if text and not self.calls:
            self._gather(-1, text)

    def start(self, name: str) -> None:
        self._flush()
        self.calls += 1
        if self._kept(self.calls - 1):
            self._events.append(CallStarted(self.calls - 1, name))

    def arguments(self, text: str) -> None:
        if text and self._kept(self.calls - 1):
            self._gather(self.calls - 1, text)

    def _kept(self, index: int) -> bool:
        return self.max_calls is None or index < self.max_calls

    def _gather(self, run: int, text: str) -> None:
        if self._run != run:
            self._flush()
            self._run = run
        self._pieces.append(text)

    def _flush(self) -> None:
        if self._run is not None and self._pieces:
            text = "".join(self._pieces)
            self._events.append(
                ContentDelta(text) if self._run < 0 else ArgumentsDelta(self._run, text)
            )
        self._run, self._pieces = None, []

    def take(self) -> list[ToolEvent]:
        self._flush()
        events, self._events = self._events, []
        return events


# ------------------------------------------------------------------------ one JSON value, checked

_WS = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')

Step = Literal["more", "done", "before", "bad"]
# "more": taken, the value goes on; "done": taken, the value is complete; "before": the value
# was complete before this character (a number), which is not taken; "bad": not valid here.

_NUMBER_ENDS = {"num_zero", "num_int", "num_frac", "num_exp"}


class _JsonValue:
    """Checks one JSON value (RFC 8259) a character at a time."""

    def __init__(self) -> None:
        self._stack: list[str] = []  # the open "{" and "["
        self._state = "value"
        self._resume = "string"  # the string state an escape returns to
        self._left = ""  # the rest of a literal, or of a \\u escape's hex digits

    def push(self, c: str) -> Step:
        state = self._state
        if state in ("string", "key"):
            if c == '"':
                if state == "key":
                    self._state = "colon"
                    return "more"
                return self._closed()
            if c == "\\":
                self._resume, self._state = state, "escape"
                return "more"
            return "bad" if c < " " else "more"
        if state == "escape":
            if c in '"\\/bfnrt':
                self._state = self._resume
                return "more"
            if c == "u":
                self._state, self._left = "unicode", "xxxx"
                return "more"
            return "bad"
        if state == "unicode":
            if c not in _HEX:
                return "bad"
            self._left = self._left[1:]
            if not self._left:
                self._state = self._resume
            return "more"
        if state.startswith("num_"):
            return self._number(c)
        if state == "literal":
            if c != self._left[0]:
                return "bad"
            self._left = self._left[1:]
            return "more" if self._left else self._closed()
        if c in _WS and state != "done":
            return "more"
        if state == "value":
            return self._start(c)
        if state == "value_or_close":
            if c == "]":
                return self._pop()
            return self._start(c)
        if state in ("key_or_close", "key_next"):
            if c == '"':
                self._state = "key"
                return "more"
            return self._pop() if c == "}" and state == "key_or_close" else "bad"
        if state == "colon":
            if c != ":":
                return "bad"
            self._state = "value"
            return "more"
        if state == "after":
            top = self._stack[-1]
            if c == ",":
                self._state = "key_next" if top == "{" else "value"
                return "more"
            if c == ("}" if top == "{" else "]"):
                return self._pop()
        return "bad"

    def _start(self, c: str) -> Step:
        if c in "{[":
            self._stack.append(c)
            self._state = "key_or_close" if c == "{" else "value_or_close"
            return "more"
        if c == '"':
            self._state = "string"
            return "more"
        if c == "-":
            self._state = "num_sign"
            return "more"
        if c in _DIGITS:
            self._state = "num_zero" if c == "0" else "num_int"
            return "more"
        for word in ("true", "false", "null"):
            if c == word[0]:
                self._state, self._left = "literal", word[1:]
                return "more"
        return "bad"

    def _number(self, c: str) -> Step:
        state = self._state
        digit = c in _DIGITS
        moves = {
            "num_sign": {"digit": "num_int", "0": "num_zero"},
            "num_zero": {".": "num_dot", "e": "num_e"},
            "num_int": {"digit": "num_int", ".": "num_dot", "e": "num_e"},
            "num_dot": {"digit": "num_frac"},
            "num_frac": {"digit": "num_frac", "e": "num_e"},
            "num_e": {"digit": "num_exp", "sign": "num_esign"},
            "num_esign": {"digit": "num_exp"},
            "num_exp": {"digit": "num_exp"},
        }[state]
        kind = (
            "0"
            if c == "0" and "0" in moves
            else "digit"
            if digit
            else "e"
            if c in "eE"
            else "sign"
            if c in "+-"
            else c
        )
        if kind in moves:
            self._state = moves[kind]
            return "more"
        if state not in _NUMBER_ENDS:
            return "bad"
        if not self._stack:
            self._state = "done"
            return "before"
        self._state = "after"
        return self.push(c)

    def _pop(self) -> Step:
        self._stack.pop()
        return self._closed()

    def _closed(self) -> Step:
        if self._stack:
            self._state = "after"
            return "more"
        self._state = "done"
        return "done"

    def run(self, text: str, start: int) -> int:
        """How many characters from ``text[start:]`` are taken at once as the plain inside of
        a string (none of ``"``, ``\\`` or a control character); 0 outside strings."""
        if self._state not in ("string", "key"):
            return 0
        found = _PLAIN.match(text, start)
        if found is None:
            return 0
        return found.end() - start

    def complete_at_end(self) -> bool:
        """Whether the text so far is a whole value when nothing follows (a bare number)."""
        return self._state == "done" or (not self._stack and self._state in _NUMBER_ENDS)


# ------------------------------------------------------------------------------ one call object


class _CallObject:
    """One ``{"name": ..., <arguments key>: ..., ...}`` object; says the call to ``sink`` once
    its name is read. ``push`` gives ``done`` (taken, the object closed) or ``bad`` (not taken:
    the object broke here, or closed without a name)."""

    def __init__(self, sink: _Sink, argument_keys: tuple[str, ...]) -> None:
        self._sink = sink
        self._keys = argument_keys
        self._state = "open"
        self._value = _JsonValue()
        self._raw = ""  # a key's or a captured value's text
        self._role = "skip"  # what the value being read is: name, arguments, arguments_text
        self.name: str | None = None
        self._started = False
        self._arguments_seen = False
        self._held = ""  # arguments read before the name

    @property
    def committed(self) -> bool:
        return self._started

    def _commit(self) -> None:
        assert self.name is not None
        self._started = True
        self._sink.start(self.name)
        self._sink.arguments(self._held)

    def push(self, c: str) -> Literal["more", "done", "bad"]:
        state = self._state
        if state == "value":
            return self._value_char(c)
        if state == "key":
            self._raw += c
            step = self._value.push(c)
            if step == "bad":
                return "bad"
            if step == "done":
                key = json.loads(self._raw)
                self._role = (
                    "name"
                    if key == "name" and self.name is None
                    else "arguments"
                    if key in self._keys and not self._arguments_seen
                    else "skip"
                )
                self._state = "colon"
            return "more"
        if c in _WS:
            return "more"
        if state == "open":
            if c != "{":
                return "bad"
            self._state = "key_or_close"
            return "more"
        if state in ("key_or_close", "key_next") and c == '"':
            self._state, self._value, self._raw = "key", _JsonValue(), '"'
            self._value.push(c)
            return "more"
        if state == "colon" and c == ":":
            self._state = "value_start"
            return "more"
        if state == "value_start":
            self._state, self._value, self._raw = "value", _JsonValue(), ""
            if self._role != "arguments":
                return self._value_char(c)
            self._arguments_seen = True
            if c == '"':
                self._role = "arguments_text"
            step = self._value_char(c)
            if step != "bad" and self.name is not None and not self._started:
                self._commit()
            return step
        if state == "after" and c == ",":
            self._state = "key_next"
            return "more"
        if (state == "after" or state == "key_or_close") and c == "}":
            return self._close()
        return "bad"

    def run(self, text: str, start: int) -> int:
        """Take the plain characters of a string from ``text[start:]`` at once (the bulk of
        most arguments); how many were taken (0: read the next one with ``push``)."""
        if self._state not in ("key", "value"):
            return 0
        taken = self._value.run(text, start)
        if taken:
            piece = text[start : start + taken]
            if self._role == "arguments" and self._state == "value":
                self._arguments(piece)
            elif self._role != "skip" or self._state == "key":
                self._raw += piece
        return taken

    def _value_char(self, c: str) -> Literal["more", "done", "bad"]:
        step = self._value.push(c)
        if step == "bad":
            return "bad"
        if step != "before":
            if self._role == "arguments":
                self._arguments(c)
            elif self._role != "skip":
                self._raw += c
        if step == "more":
            return "more"
        self._end_value()
        self._state = "after"
        return "more" if step == "done" else self.push(c)

    def _end_value(self) -> None:
        if self._role == "name":
            value = json.loads(self._raw)
            if isinstance(value, str):
                self.name = value
                if self._arguments_seen:
                    self._commit()
        elif self._role == "arguments_text":
            self._arguments(json.loads(self._raw))

    def _arguments(self, text: str) -> None:
        if not self._started:
            self._held += text
        else:
            self._sink.arguments(text)

    def _close(self) -> Literal["done", "bad"]:
        if self.name is None:
            return "bad"
        if not self._started:
            self._commit()
        if not self._arguments_seen:
            self._sink.arguments("{}")
        self._state = "closed"
        return "done"


class _Calls:
    """The calls after a marker (or a whole output): one call object, or with ``allow_list`` a
    JSON list of them."""

    def __init__(self, sink: _Sink, argument_keys: tuple[str, ...], allow_list: bool) -> None:
        self._sink = sink
        self._keys = argument_keys
        self._allow_list = allow_list
        self._state = "start"
        self._listed = False
        self._object: _CallObject | None = None
        self._committed = False

    @property
    def committed(self) -> bool:
        return self._committed or (self._object is not None and self._object.committed)

    def read(self, text: str) -> tuple[Literal["more", "done", "bad"], int, str]:
        """Take ``text`` as far as the calls go: ``more`` (all of it taken), ``done`` (the
        calls ended; the position after their end) or ``bad`` (the position of the character
        refused); and the part taken before a call was committed (content if none is)."""
        tentative: list[str] = []
        position = 0
        while position < len(text):
            inside = self._object if self._state == "object" else None
            run = 0 if inside is None else inside.run(text, position)
            if run:
                if not self.committed:
                    tentative.append(text[position : position + run])
                position += run
                continue
            step = self.push(text[position])
            if step != "more":
                return step, position + (1 if step == "done" else 0), "".join(tentative)
            if not self.committed:
                tentative.append(text[position])
            position += 1
        return "more", position, "".join(tentative)

    def push(self, c: str) -> Literal["more", "done", "bad"]:
        state = self._state
        if state == "object":
            assert self._object is not None
            step = self._object.push(c)
            if step != "done":
                return step
            self._committed = True
            if not self._listed:
                return "done"
            self._state = "list_after"
            return "more"
        if c in _WS:
            return "more"
        if c == "{" and state in ("start", "list_first", "list_next"):
            self._object = _CallObject(self._sink, self._keys)
            self._state = "object"
            return self._object.push(c)
        if c == "[" and state == "start" and self._allow_list:
            self._state, self._listed = "list_first", True
            return "more"
        if state == "list_after":
            if c == ",":
                self._state = "list_next"
                return "more"
            if c == "]":
                return "done"
        return "bad"


# ----------------------------------------------------------------------------------- the readers


class ToolCallReader(ABC):
    """Reads one choice's output as it streams: ``feed`` each piece of text, then ``finish``;
    each returns what became certain (``ToolEvent``s, neighbours of a kind merged)."""

    def __init__(self, max_calls: int | None = None) -> None:
        self._sink = _Sink(max_calls)

    @property
    def calls(self) -> int:
        """How many calls were read (all of them, also those past ``max_calls``)."""
        return self._sink.calls

    def feed(self, text: str) -> list[ToolEvent]:
        self._read(text, final=False)
        return self._sink.take()

    def finish(self) -> list[ToolEvent]:
        self._read("", final=True)
        return self._sink.take()

    @abstractmethod
    def _read(self, text: str, final: bool) -> None:
        """Take ``text`` (the last of it when ``final``), telling the sink what is certain."""


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that starts ``marker`` (but is not all of it)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class MarkedReader(ToolCallReader):
    """Content, then calls each after ``marker``: ``<tool_call>`` blocks of one object
    (Hermes), or ``[TOOL_CALLS]`` and a list (Mistral)."""

    def __init__(
        self,
        marker: str,
        argument_keys: tuple[str, ...],
        allow_list: bool,
        max_calls: int | None = None,
    ) -> None:
        super().__init__(max_calls)
        self._marker = marker
        self._keys = argument_keys
        self._allow_list = allow_list
        self._text = ""  # not read yet: content held back, or the rest of a piece
        self._calls: _Calls | None = None
        self._tentative = ""  # a block not yet a call: content if it never becomes one

    def _read(self, text: str, final: bool) -> None:
        self._text += text
        sink = self._sink
        while True:
            if self._calls is None:
                found = self._text.find(self._marker)
                if found < 0:
                    if final:
                        sink.content(self._text)
                        self._text = ""
                        return
                    cut = len(self._text) - _partial_marker(self._text, self._marker)
                    certain = self._text[:cut].rstrip()
                    sink.content(certain)
                    self._text = self._text[len(certain) :]
                    return
                before = self._text[:found]
                certain = before.rstrip()
                sink.content(certain)
                self._tentative = before[len(certain) :] + self._marker
                self._text = self._text[found + len(self._marker) :]
                self._calls = _Calls(sink, self._keys, self._allow_list)
                continue
            step, end, taken = self._calls.read(self._text)
            self._tentative += taken
            if step == "more" and not final:
                self._text = ""
                return
            sink.content(self._tentative)  # dropped when the block was a call
            self._tentative, self._calls = "", None
            self._text = self._text[end:]
            if step == "more":
                return


class BareReader(ToolCallReader):
    """Output that is calls throughout: a JSON object or a list of them, after an optional
    ``prefix`` (Llama 3's ``<|python_tag|>``); output that starts otherwise is content."""

    def __init__(
        self, argument_keys: tuple[str, ...], prefix: str = "", max_calls: int | None = None
    ) -> None:
        super().__init__(max_calls)
        self._keys = argument_keys
        self._prefix = prefix
        self._state: Literal["start", "calls", "content"] = "start"
        self._text = ""  # held at the start, until its first character decides
        self._calls = _Calls(self._sink, argument_keys, allow_list=True)

    def _read(self, text: str, final: bool) -> None:
        sink = self._sink
        if self._state == "start":
            self._text += text
            head = self._text.lstrip()
            if self._prefix and head.startswith(self._prefix):
                head = head[len(self._prefix) :].lstrip()
            elif self._prefix and self._prefix.startswith(head) and not final:
                return
            if not head:
                if final:
                    sink.content(self._text)
                return
            if head[0] in "{[":
                self._state = "calls"
                text, self._text = head, self._text[: len(self._text) - len(head)]
            else:
                self._state = "content"
                text, self._text = self._text, ""
        if self._state == "calls":
            step, end, taken = self._calls.read(text)
            self._text += taken
            if step == "more":
                if final:
                    sink.content(self._text)
                return
            sink.content(self._text)  # dropped when there was a call
            self._state = "content"
            text = text[end:]
        sink.content(text)  # dropped after a call


class ArgumentsReader(ToolCallReader):
    """Output that is one named call's arguments (``tool_choice`` names the function)."""

    def __init__(self, name: str) -> None:
        super().__init__(max_calls=1)
        self._name = name

    def _read(self, text: str, final: bool) -> None:
        if not self._sink.calls:
            self._sink.start(self._name)
        self._sink.arguments(text)


READERS: dict[str, Callable[[int | None], ToolCallReader]] = {
    "hermes": lambda max_calls: MarkedReader(
        "<tool_call>", ("arguments",), allow_list=False, max_calls=max_calls
    ),
    "llama3_json": lambda max_calls: BareReader(
        ("parameters", "arguments"), "<|python_tag|>", max_calls
    ),
    "mistral": lambda max_calls: MarkedReader(
        "[TOOL_CALLS]", ("arguments", "parameters"), allow_list=True, max_calls=max_calls
    ),
}


def read_all(reader: ToolCallReader, text: str) -> ParsedOutput:
    """The one-shot parse: ``reader`` given the whole text at once."""
    return assemble(reader.feed(text) + reader.finish())


def parse_hermes(text: str) -> ParsedOutput:
    return read_all(READERS["hermes"](None), text)


def parse_llama3_json(text: str) -> ParsedOutput:
    return read_all(READERS["llama3_json"](None), text)


def parse_mistral(text: str) -> ParsedOutput:
    return read_all(READERS["mistral"](None), text)


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's convention calls for; Hermes where it names none (the
    convention ``engine.api.chat`` spells out for templates without tools)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ("ipython" in text and "<tool_call>" not in text):
        return "llama3_json"
    return "hermes"
