"""Structured logs: JSON lines, context ids on every line, no content or secrets by default."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.observability.logging import configure_logging, redact_field, reset_logging

CONTENT_FIELDS = ["prompt", "completion", "messages", "message", "content", "output_text", "body"]
SECRET_FIELDS = ["api_key", "key", "authorization", "secret", "client_secret", "password", "bearer"]


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    structlog.contextvars.clear_contextvars()
    reset_logging()


@pytest.fixture
def stream() -> io.StringIO:
    return io.StringIO()


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


canary = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=12, max_size=40
)


@settings(max_examples=50)
@given(canary, st.sampled_from(CONTENT_FIELDS + SECRET_FIELDS))
def test_content_and_secret_fields_never_reach_a_line(text: str, field: str) -> None:
    out = io.StringIO()
    configure_logging(log_format="json", stream=out)
    structlog.get_logger("t").warning("completion finished", **{field: text}, nested={field: text})
    logging.getLogger("library").error("library line", extra={f"request_{field}": text})
    assert text not in out.getvalue()
    first, second = lines(out)
    assert first["event"] == "completion finished" and first["nested"] == {}
    assert second["event"] == "library line"


def test_counts_ids_and_digests_are_kept(stream: io.StringIO) -> None:
    configure_logging(log_format="json", stream=stream)
    structlog.get_logger("t").info(
        "audited",
        prompt_tokens=12,
        key_id="k-1",
        key_name="app-one",
        prompt_sha256="ab" * 32,
        fallback_active=True,
        api_key="sk-live-secret",
    )
    (line,) = lines(stream)
    assert {k: line[k] for k in ("prompt_tokens", "key_id", "key_name", "prompt_sha256")} == {
        "prompt_tokens": 12,
        "key_id": "k-1",
        "key_name": "app-one",
        "prompt_sha256": "ab" * 32,
    }
    assert "api_key" not in line


def test_content_opt_in_releases_content_but_never_secrets(stream: io.StringIO) -> None:
    configure_logging(log_format="json", stream=stream, log_content=True)
    structlog.get_logger("t").info("debugging", prompt="hello there", authorization="Bearer sk-1")
    (line,) = lines(stream)
    assert line["prompt"] == "hello there"
    assert "authorization" not in line


def test_every_line_of_a_request_carries_request_and_trace_id(stream: io.StringIO) -> None:
    configure_logging(log_format="json", stream=stream)
    with structlog.contextvars.bound_contextvars(request_id="req-1", trace_id="ab" * 16):
        structlog.get_logger("gateway").info("first")
        logging.getLogger("sqlalchemy").warning("second")
    structlog.get_logger("gateway").info("outside")
    first, second, outside = lines(stream)
    for line in (first, second):
        assert (line["request_id"], line["trace_id"]) == ("req-1", "ab" * 16)
    assert "request_id" not in outside
    assert first["logger"] == "gateway" and second["logger"] == "sqlalchemy"
    assert first["level"] == "info" and second["level"] == "warning"


def test_level_filters_and_tracebacks_carry_no_locals(stream: io.StringIO) -> None:
    configure_logging(log_format="json", level="warning", stream=stream)
    log = structlog.get_logger("t")
    log.info("hidden")

    def fail(prompt: str) -> None:
        raise ValueError("boom")

    prompt = "-".join(["SECRET", "PROMPT", "TEXT"])
    try:
        fail(prompt)
    except ValueError:
        log.exception("failed")
    (line,) = lines(stream)
    assert line["event"] == "failed"
    assert "ValueError: boom" in str(line["exception"])
    assert "SECRET-PROMPT-TEXT" not in stream.getvalue()


def test_console_format_is_readable_and_redacted(stream: io.StringIO) -> None:
    configure_logging(log_format="console", stream=stream)
    structlog.get_logger("t").info("started", model="demo", prompt="do not show")
    text = stream.getvalue()
    assert "started" in text and "model=demo" in text
    assert "do not show" not in text
    assert not text.lstrip().startswith("{")


@pytest.mark.parametrize(
    ("name", "value", "dropped"),
    [
        ("prompt", "x", True),
        ("prompt_tokens", 3, False),
        ("prompt_sha256", "ab", False),
        ("api_key", "sk", True),
        ("key_id", "k1", False),
        ("x-api-key", "sk", True),
        ("Authorization", "Bearer x", True),
        ("token_ids", [1, 2], True),
        ("num_output_tokens", 4, False),
        ("route", "/v1/chat/completions", False),
        ("event", "prompt received", False),
    ],
)
def test_field_rules(name: str, value: object, dropped: bool) -> None:
    assert redact_field(name, value, log_content=False) is dropped
