"""One call from a command to a running gateway's API: a POST with an API key, its JSON
answer, and the exit codes such commands share (2: the gateway could not be asked or refused;
a caller may give other codes to statuses that mean something to it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import typer


def post_to_gateway(
    url: str,
    path: str,
    key: str,
    *,
    body: Mapping[str, Any] | None = None,
    params: Mapping[str, str] | None = None,
    timeout_s: float,
    exit_codes: Mapping[int, int] | None = None,
) -> Any:
    """The JSON answer to ``POST {url}{path}``; on any other status than 200, the gateway's
    error message on one line and exit ``exit_codes[status]`` (2 by default)."""
    import httpx

    try:
        response = httpx.post(
            f"{url.rstrip('/')}{path}",
            json=body,
            params=params,
            headers={"authorization": f"Bearer {key}"},
            timeout=timeout_s,
        )
    except httpx.HTTPError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    if response.status_code != 200:
        message = response.json().get("error", {}).get("message", response.text)
        typer.echo(f"error ({response.status_code}): {message}", err=True)
        raise typer.Exit((exit_codes or {}).get(response.status_code, 2))
    return response.json()
