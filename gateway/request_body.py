"""JSON request bodies are parsed, and checked, in one place, before any route sees them.

Two things in a body that parses as JSON would otherwise fail later, far from their cause:
a lone surrogate (``"\\udfff"``: valid JSON, but not Unicode, so nothing can encode it: not
the database, not an error message repeating the value) and nesting deep enough to exhaust
the recursion of the parser or of whatever walks the value afterwards. Routes whose body is
JSON declare ``route_class=CheckedBodyRoute``; FastAPI then reads their body through
``parsed_json``, which refuses both with a 400 in OpenAI's error shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from gateway.errors import APIError, RefusedBody

# Far above any request this API takes (a chat body with content parts nests 5 levels, a
# JSON schema for a tool or an output a few more), far below Python's recursion limit.
MAX_JSON_DEPTH = 100


def _not_unicode(where: str) -> APIError:
    return APIError(
        400,
        f"Invalid value for '{where}': the text is not valid Unicode "
        "(it contains a lone surrogate).",
        param=where,
        code="invalid_text",
    )


def _too_deep() -> APIError:
    return APIError(
        400,
        f"The request body is JSON nested more than {MAX_JSON_DEPTH} levels deep.",
        code="json_too_deep",
    )


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _members(value: dict[str, Any] | list[Any], where: str) -> list[tuple[str, Any]]:
    """A container's members with their locations, in document order."""
    if isinstance(value, dict):
        return [((f"{where}.{key}" if where else key), item) for key, item in value.items()]
    return [(f"{where}[{index}]", item) for index, item in enumerate(value)]


def check_parsed(value: Any) -> None:
    """Raise APIError for the first string or key (in document order) that is not Unicode,
    named by its location (``messages[0].content``; a key by its object's, ``body`` at the
    top), or for nesting beyond ``MAX_JSON_DEPTH``. Iterative: no recursion to exhaust."""
    pending: list[tuple[str, Any, int]] = [("", value, 0)]
    while pending:
        where, item, depth = pending.pop()
        if isinstance(item, str) and not _is_unicode(item):
            raise _not_unicode(where or "body")
        if not isinstance(item, dict | list):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise _too_deep()
        if isinstance(item, dict) and not all(_is_unicode(key) for key in item):
            raise _not_unicode(where or "body")
        members = _members(item, where)
        pending.extend((path, member, depth + 1) for path, member in reversed(members))


def parsed_json(body: bytes) -> Any:
    """``body`` decoded as JSON and checked (``check_parsed``); malformed JSON raises as
    ``json.loads`` does, for FastAPI's own 400."""
    try:
        value = json.loads(body)
    except RecursionError:  # nested beyond what the parser can recurse into
        raise RefusedBody(_too_deep()) from None
    try:
        check_parsed(value)
    except APIError as error:
        raise RefusedBody(error) from None
    return value


class CheckedBodyRequest(Request):
    async def json(self) -> Any:
        return parsed_json(await self.body())


class CheckedBodyRoute(APIRoute):
    """A route whose JSON body is read through ``parsed_json``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def checked(request: Request) -> Response:
            return await handle(CheckedBodyRequest(request.scope, request.receive))

        return checked
