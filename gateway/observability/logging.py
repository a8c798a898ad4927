"""Structured logging: JSON lines in production, readable console output in development.

structlog renders through the standard library's ``logging``, so lines from uvicorn,
SQLAlchemy and other libraries come out in the same format and through the same
redaction. Request id and trace id are bound per request with structlog's contextvars
(see :mod:`gateway.observability.middleware`), so every line of a request carries them.

Redaction works on field names. Content fields (prompt, completion, message, content,
text, token) are dropped unless ``log_content`` is on; secret fields (key, secret,
authorization, password, credential, bearer) are dropped always, since no opt-in should
ever put a key in a log. Numbers and booleans are kept under any name (``prompt_tokens``
is a count, not text), as are identifiers and digests (``key_id``, ``prompt_sha256``).
Tracebacks are rendered without local variables, which could hold a prompt.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from typing import IO, Any, Literal

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

LogFormat = Literal["json", "console"]

CONTENT_WORDS = frozenset(
    {
        "prompt",
        "prompts",
        "completion",
        "completions",
        "message",
        "messages",
        "content",
        "contents",
        "text",
        "texts",
        "token",
        "input",
        "output",
        "body",
    }
)
SECRET_WORDS = frozenset(
    {
        "key",
        "keys",
        "apikey",
        "secret",
        "secrets",
        "authorization",
        "password",
        "passwd",
        "credential",
        "credentials",
        "bearer",
        "cookie",
        "plaintext",
    }
)
# A last word that makes a field a reference or a digest rather than the thing itself.
REFERENCE_WORDS = frozenset({"id", "name", "names", "sha256", "hash", "role", "version", "count"})
# structlog's own fields: the message and the metadata every line has.
_STRUCTURAL_FIELDS = frozenset(
    {"event", "level", "timestamp", "logger", "request_id", "trace_id", "span_id"}
)

_WORD_SPLIT = re.compile(r"[^a-z0-9]+")
_HANDLER_NAME = "specgate"


def redact_field(name: str, value: object, *, log_content: bool) -> bool:
    """True if the field ``name`` with ``value`` must not appear in a log line."""
    if name in _STRUCTURAL_FIELDS or isinstance(value, bool | int | float) or value is None:
        return False
    words = [w for w in _WORD_SPLIT.split(name.lower()) if w]
    if not words or words[-1] in REFERENCE_WORDS:
        return False
    if SECRET_WORDS.intersection(words):
        return True
    return not log_content and bool(CONTENT_WORDS.intersection(words))


class RedactSensitiveFields:
    """A structlog processor that drops content and secret fields, also inside nested dicts."""

    def __init__(self, *, log_content: bool) -> None:
        self.log_content = log_content

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        return self._clean(event_dict)

    def _clean(self, mapping: Mapping[str, Any]) -> dict[str, Any]:
        return {
            name: self._clean(value) if isinstance(value, dict) else value
            for name, value in mapping.items()
            if not redact_field(str(name), value, log_content=self.log_content)
        }


def default_log_format(stream: IO[str]) -> LogFormat:
    """Console output for a person at a terminal, JSON lines for anything else."""
    return "console" if stream.isatty() else "json"


def configure_logging(
    *,
    log_format: LogFormat | None = None,
    level: str = "info",
    log_content: bool = False,
    stream: IO[str] | None = None,
) -> None:
    """Set up structlog and the standard library's root logger for the whole process.

    Idempotent: a second call replaces the handler the first one installed.
    """
    out = stream or sys.stdout
    fmt = log_format or default_log_format(out)
    numeric_level = logging.getLevelNamesMapping()[level.upper()]
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    # Redacted before the event reaches any stdlib handler, ours or one added by a library.
    redact = RedactSensitiveFields(log_content=log_content)
    context: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
    ]
    renderer: Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        exceptions: list[Processor] = [structlog.processors.format_exc_info]
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=out.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
        exceptions = []
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*context, structlog.stdlib.ExtraAdder(), timestamper, redact],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *exceptions,
            renderer,
        ],
    )
    handler = logging.StreamHandler(out)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for existing in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(numeric_level)
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *context,
            structlog.stdlib.PositionalArgumentsFormatter(),
            timestamper,
            structlog.processors.StackInfoRenderer(),
            redact,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


def reset_logging() -> None:
    """Undo :func:`configure_logging`: structlog's defaults, and the root handler removed."""
    root = logging.getLogger()
    for existing in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(existing)
    root.setLevel(logging.WARNING)
    structlog.reset_defaults()
