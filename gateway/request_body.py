"""JSON request bodies are parsed, and checked, in one place, before any route sees them.

A body that parses as JSON can still hold a lone surrogate (``"\\udfff"``: valid JSON, but
not Unicode, so nothing can encode it: not the database, not an error message repeating the
value), which would fail later, far from its cause. Routes whose body is JSON declare
``route_class=CheckedBodyRoute``; FastAPI then reads their body through ``parsed_json``,
which refuses it with a 400 in OpenAI's error shape naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from gateway.errors import APIError, RefusedBody


def _not_unicode(where: str) -> APIError:
    return APIError(
        400,
        f"Invalid value for '{where}': the text is not valid Unicode "
        "(it contains a lone surrogate).",
        param=where,
        code="invalid_text",
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
    top). Iterative: no recursion to exhaust."""
    pending: list[tuple[str, Any]] = [("", value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, str) and not _is_unicode(item):
            raise _not_unicode(where or "body")
        if not isinstance(item, dict | list):
            continue
        if isinstance(item, dict) and not all(_is_unicode(key) for key in item):
            raise _not_unicode(where or "body")
        pending.extend(reversed(_members(item, where)))


def parsed_json(body: bytes) -> Any:
    """``body`` decoded as JSON and checked (``check_parsed``); malformed JSON raises as
    ``json.loads`` does, for FastAPI's own 400."""
    value = json.loads(body)
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
